"""Samples per second of asynchronous GRPO (max_trajectory_age_steps=1) against the synchronous data-plane trainer,
side by side in one run (issue 16, item 6).

Why: async only pays off when generation and training overlap on the machine, so the claim must be measured on the
machine, on the same workload, alternating the two trainers so a shared box disturbs both alike.

Workload: the default run's config (arithmetic, 16 prompts x 8 generations, <= 16 new tokens, KL 0.02 against a
reference model, one optimizer step per step, 1 torch thread per side: async's generation runs in its own
process) without validation or checkpoints, on two
models: `default` (the shipped ~1M-parameter builtin:tiny-arith) and `25m` (a random Qwen2 widened to ~25M
parameters: hidden 512, 6 layers, 8 heads, MLP 2048, relayrl's character tokenizer). Each (model, trainer) run is a
fresh subprocess; the first `--warmup` steps are discarded.

Step time = wall clock between the ends of consecutive steps (the moment the loop logs the step's timing), so async's
number includes any wait for the producer; samples/s = rows per step / median step time. CPU seconds per step
(this process's CPU time, all threads; not the generation process) are reported too, and per side: the training
(main) thread's CPU seconds per step and the producer's per batch (its thread plus its generation process). With a core per side, a side's CPU seconds are its wall time, so
`projected_2core_step_s` = max(trainer, producer) (sync: its CPU seconds) projects the step of a quiet 2-core box;
on a box shared with other jobs the measured wall clock understates the overlap (no free core to overlap onto).

Run (about 6 minutes on a quiet 2-core CPU; `--executor ray` runs both trainers on Ray actors with a dedicated
generation worker, where CPU seconds per side are not visible to this process):

    HF_HUB_OFFLINE=1 python bench/async_vs_sync.py --steps 8 --rounds 2 --models default 25m
    HF_HUB_OFFLINE=1 python bench/async_vs_sync.py --steps 8 --rounds 2 --models default --executor ray
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from model_shapes import WIDE_25M  # bench/model_shapes.py

SEED = 42


def build_wide_model(path: Path) -> int:
    """A random Qwen2 of ~25M parameters with the shipped character tokenizer; returns its parameter count."""
    from relayrl.models.tiny import build_char_tokenizer, build_tiny_qwen2, count_parameters, save_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(len(tokenizer), seed=SEED, **WIDE_25M)  # type: ignore[arg-type]
    save_tiny_model(path, model, tokenizer)
    return count_parameters(model)


#: `trl`: the workload of bench/trl_vs_relayrl.py (8 prompts x 4 generations, <= 64 new tokens, KL 0.04), where
#: generation is a larger share of the step than in the default run's.
WORKLOADS = {
    "default": [],
    "trl": [
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=32",
        "policy.generation.max_new_tokens=64",
        "policy.max_total_sequence_length=128",
        "loss_fn.reference_policy_kl_penalty=0.04",
        "policy.optimizer.kwargs.lr=1e-5",
        "policy.scheduler.name=constant",
    ],
}


#: `--executor ray`: one training rank and one dedicated generation worker as Ray actors, the `ray` store (both
#: trainers use the same layout; async needs dedicated workers there).
EXECUTORS = {
    "local": [],
    "ray": [
        "cluster.executor=ray",
        "cluster.workers_per_node=1",
        "data_plane.backend=ray",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.num_nodes=1",
        "policy.generation.colocated.resources.workers_per_node=1",
    ],
}


def overrides(model: str, steps: int, trainer: str, workload: str = "default", executor: str = "local") -> list[str]:
    out = [
        *WORKLOADS[workload],
        *EXECUTORS[executor],
        f"policy.model_name={model}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "logger.num_train_samples_to_log=0",
        "cluster.torch_num_threads=1",
        "data_plane.enabled=true",
    ]
    if trainer == "async":
        out += ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1"]
    return out


def run_worker(args: argparse.Namespace) -> None:
    """One training run in this process; records the wall and CPU clock at every step end."""
    import torch

    from relayrl.algorithms.setup import run_training
    from relayrl.utils import logger as logger_mod
    from relayrl.utils.config_io import load_config

    torch.set_num_threads(1)
    ends: list[tuple[float, float]] = []
    log_metrics = logger_mod.Logger.log_metrics

    def clocked(self: Any, metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        if prefix == "timing/train":
            ends.append((time.perf_counter(), time.process_time(), time.thread_time()))
        log_metrics(self, metrics, step, prefix=prefix)

    logger_mod.Logger.log_metrics = clocked  # type: ignore[method-assign]
    cfg = load_config(
        None, overrides(args.model_dir, args.steps + args.warmup, args.worker, args.workload, args.executor)
    )
    with tempfile.TemporaryDirectory(prefix=f"bench_{args.worker}_") as tmp:
        run_training(cfg, Path(tmp) / "run")
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    phases: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("timing/train/") and isinstance(v, (int, float)):
                phases.setdefault(k.removeprefix("timing/train/"), []).append(float(v))
    wall = [b[0] - a[0] for a, b in zip(ends, ends[1:])]
    cpu = [b[1] - a[1] for a, b in zip(ends, ends[1:])]
    trainer_cpu = [b[2] - a[2] for a, b in zip(ends, ends[1:])]  # the main (training) thread only
    producer_cpu = [float(r["timing/async/producer_cpu"]) for r in rows if "timing/async/producer_cpu" in r]
    w = args.warmup - 1
    rec = {"wall": wall[w:], "cpu": cpu[w:], "trainer_cpu": trainer_cpu[w:], "phases": phases}
    rec["producer_cpu"] = producer_cpu[args.warmup :]
    rec["rows"] = cfg.grpo.rows_per_step
    rec["load"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(rec))


def spawn(kind: str, model: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--worker", kind, "--model-dir", model, "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--workload", args.workload]
    cmd += ["--executor", args.executor]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{kind} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    wall = [w for r in runs for w in r["wall"]]
    cpu = [c for r in runs for c in r["cpu"]]
    med = statistics.median(wall)
    trainer = statistics.median([c for r in runs for c in r["trainer_cpu"]])
    producer = [c for r in runs for c in r["producer_cpu"]]
    # a side's CPU seconds per step is its wall time when it has a core of its own: the step of a quiet 2-core box
    busiest = max(trainer, statistics.median(producer)) if producer else statistics.median(cpu)
    phases = {k: statistics.median([v for r in runs for v in r["phases"].get(k, [])]) for k in runs[0]["phases"]}
    return {
        "step_s": med,
        "samples_per_s": runs[0]["rows"] / med,
        "cpu_s_per_step": statistics.median(cpu),
        "trainer_thread_cpu_s": trainer,
        "producer_thread_cpu_s": statistics.median(producer) if producer else 0.0,
        "projected_2core_step_s": busiest,
        **{f"phase/{k}": v for k, v in phases.items() if k in _SHOWN},
    }


_SHOWN = ("generation", "waiting", "prev_logprobs", "reference", "policy_training", "total_step_time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="steady steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="leading steps discarded per run (>= 1)")
    p.add_argument("--rounds", type=int, default=2, help="sync/async alternations per model")
    p.add_argument("--models", nargs="+", default=["default", "25m"], choices=["default", "25m"])
    p.add_argument("--workload", default="default", choices=sorted(WORKLOADS), help="default run's, or TRL bench's")
    p.add_argument(
        "--executor", default="local", choices=sorted(EXECUTORS), help="local, or Ray actors (see EXECUTORS)"
    )
    p.add_argument("--worker", choices=["sync", "async"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return run_worker(args)
    if args.warmup < 1:
        sys.exit("--warmup must be >= 1 (the first step has no previous step end)")
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        report: dict[str, Any] = {}
        for name in args.models:
            model = "builtin:tiny-arith"
            if name == "25m":
                model = str(Path(tmp) / "wide")
                print(f"25m model: {build_wide_model(Path(model)) / 1e6:.1f}M parameters", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
            for r in range(args.rounds):
                for kind in ("sync", "async"):
                    runs[kind].append(spawn(kind, model, args, Path(tmp) / f"{name}_{kind}_{r}.json"))
                    print(f"{name} round {r + 1} {kind}: load {runs[kind][-1]['load']:.2f}", flush=True)
            s, a = summarize(runs["sync"]), summarize(runs["async"])
            report[name] = {
                "sync": s,
                "async": a,
                "speedup_samples_per_s": a["samples_per_s"] / s["samples_per_s"],
                "projected_2core_speedup": s["projected_2core_step_s"] / a["projected_2core_step_s"],
            }
            print(f"\n{name}: {'':<34}{'sync':>10}{'async d=1':>12}")
            for key in s:
                print(f"  {key:<40}{s[key]:>10.3f}{a.get(key, float('nan')):>12.3f}")
            print(f"  samples/s async/sync: {report[name]['speedup_samples_per_s']:.2f}x (measured wall)")
            if args.executor == "local":  # on Ray the sides run in actors whose CPU this process cannot see
                print(f"  projected on 2 free cores: {report[name]['projected_2core_speedup']:.2f}x", flush=True)
        print(json.dumps(report))


if __name__ == "__main__":
    main()

"""relayrl's GRPO step time against TRL's GRPOTrainer on one identical CPU set-up (issue 3, item 8).

Why: the acceptance bar is "relayrl at least twice as fast as TRL" (median step-time ratio relayrl/TRL <= 0.5) on
the workload of `shared/reference/peers.md` section B, so both trainers must do the same work per step.

Set-up shared by both: a random Qwen2 (hidden 128, 2 layers, 4 heads / 4 KV heads, intermediate 512, tied
embeddings) with relayrl's character tokenizer, saved once to a temporary directory and loaded by path by each
trainer (policy and reference copy); arithmetic prompts rendered with the chat template; 8 prompts x 4 generations
per step; <= 64 new tokens; temperature 1; KL coefficient 0.04 with a reference model; AdamW, lr 1e-5, constant
schedule, grad-norm clip 1.0; fp32 unless `--precision` says otherwise; 1 torch thread; no gradient checkpointing; no validation, checkpointing or
per-step logging in TRL's loop (relayrl writes its own metrics.jsonl line per step, which it always does). The
reward is relayrl's `MathEnvironment.step` on both sides (exact `\\boxed{}` check).
Each side runs its own defaults beyond that: relayrl decodes through its compiled CPU step (built, or found in
its cache, before the first round), TRL through `model.generate`.

Step time = wall clock from the end of one optimizer step to the end of the next, on both sides (TRL: callback
`on_step_end`; relayrl: the moment the loop logs the step's timing metrics), so each covers data fetch,
generation, reward, reference/old log-probs, advantages and the update. Each round runs TRL, then relayrl, each in
a fresh subprocess; the first `--warmup` steps of every run are discarded.

Run (about 2.5 minutes on a quiet 2-core CPU, up to 5 when the box is shared):

    HF_HUB_OFFLINE=1 python bench/trl_vs_relayrl.py --steps 20 --rounds 2
    HF_HUB_OFFLINE=1 python bench/trl_vs_relayrl.py --steps 6 --rounds 1 --model-size 25m   # ~25M parameters

`--relayrl-override KEY=VALUE` (repeatable) adds relayrl config overrides, e.g. to measure a candidate speed-up.
`--precision float32 bfloat16` runs both sides in each precision, interleaved (relayrl `policy.precision`: bf16
autocast over float32 master weights, bf16 generation; TRL `bf16=True`: autocast in training and in
`model.generate`), and prints each side's bf16 speed-up and relayrl/TRL with each side at its fastest precision;
`--trl-threads` with no value runs relayrl alone (its bf16 vs fp32 step):

    HF_HUB_OFFLINE=1 python bench/trl_vs_relayrl.py --model-size 25m --precision float32 bfloat16 --steps 6 --rounds 1
Besides wall time, both sides report CPU seconds per step and per phase, which a shared box disturbs far less.

The fp32 floor line says how far any implementation of relayrl's step could go here: the step's linear-layer
matmul FLOPs (generation, reference pass, forward + backward) divided by two cores at the single-core matmul
throughput measured before the rounds. At 25M parameters the step is compute-bound, so a ratio to TRL below the
floor's cannot be reached in float32 on this machine, whatever the scheduling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from model_shapes import WIDE_25M  # bench/model_shapes.py
from step_meter import StepMeter, fp32_floor, gemm_peak_gflops, matmul_flops_per_token, median

NUM_PROMPTS, NUM_GENERATIONS, MAX_NEW_TOKENS = 8, 4, 64
KL_BETA, SEED = 0.04, 42


# ---------------------------------------------------------------------------------------------------- shared
#: `--model-size`: `tiny` is build_tiny_qwen2's defaults (hidden 128, 4 heads, 4 KV heads, MLP 512, tied
#: embeddings) with 2 layers (~0.56M parameters); `25m` widens it (hidden 512, 6 layers, 8 heads, MLP 2048).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=2),
    "25m": WIDE_25M,
}


def build_model_dir(path: Path, size: str = "tiny") -> int:
    """Save the random Qwen2 of `size` + char tokenizer once; returns the parameter count."""
    from relayrl.models.tiny import build_char_tokenizer, build_tiny_qwen2, count_parameters, save_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(len(tokenizer), seed=SEED, **MODEL_SIZES[size])  # type: ignore[arg-type]
    save_tiny_model(path, model, tokenizer)
    return count_parameters(model)


# ---------------------------------------------------------------------------------------------------- TRL worker
def run_trl(
    model_dir: str, total_steps: int, lr: float, work_dir: Path, threads: int = 1, precision: str = "float32"
) -> dict[str, Any]:
    """TRL GRPOTrainer with `threads` torch threads (bf16: its `bf16=True`, autocast over float32 weights); per-step
    wall time, rollout/sampling phase time, tokens."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.environments.math_env import MathEnvironment
    from relayrl.experience.arithmetic import all_problems, split_problems

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, _ = split_problems(all_problems(), num_val=200)
    rows = [
        {
            "prompt": tokenizer.apply_chat_template(
                [{"role": "user", "content": p.problem}], tokenize=False, add_generation_prompt=True
            ),
            "answer": p.answer,
        }
        for p in train
    ]
    env = MathEnvironment()

    def math_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        """relayrl's own environment step (the call its rollout makes), so both sides score identically."""
        logs = [[{"role": "assistant", "content": c}] for c in completions]
        return env.step(logs, [{"ground_truth": a} for a in answer]).rewards.tolist()

    meter = StepMeter()

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            meter.start()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            meter.end_step()

    args = GRPOConfig(
        output_dir=str(work_dir / "trl_out"),
        use_cpu=True,
        bf16=precision == "bfloat16",
        activation_checkpointing=False,
        max_steps=total_steps,
        per_device_train_batch_size=NUM_PROMPTS * NUM_GENERATIONS,
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        beta=KL_BETA,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=SEED,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[math_reward],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    # rollout = sampling + reward + reference log-probs + advantages; train = the rest of the step.
    count = lambda out: meter.rec["gen_tokens"].append(float(out["completion_mask"].sum()))  # noqa: E731
    meter.wrap(trainer, "_generate_and_score_completions", "rollout", after=count)
    meter.wrap(trainer, "_generate_single_turn", "generation")
    try:
        trainer.train()
    finally:
        env.shutdown()
    return meter.rec


# ---------------------------------------------------------------------------------------------------- relayrl worker
def relayrl_overrides(model_dir: str, total_steps: int, lr: float, precision: str = "float32") -> list[str]:
    """The same set-up as TRL's, spelled as relayrl config overrides."""
    return [
        f"policy.model_name={model_dir}",
        f"grpo.num_prompts_per_step={NUM_PROMPTS}",
        f"grpo.num_generations_per_prompt={NUM_GENERATIONS}",
        f"grpo.max_num_steps={total_steps}",
        f"grpo.seed={SEED}",
        f"policy.train_global_batch_size={NUM_PROMPTS * NUM_GENERATIONS}",
        f"policy.train_micro_batch_size={NUM_PROMPTS * NUM_GENERATIONS}",
        f"policy.generation.max_new_tokens={MAX_NEW_TOKENS}",
        "policy.generation.temperature=1.0",
        "policy.max_total_sequence_length=128",
        f"policy.precision={precision}",
        "policy.activation_checkpointing=false",
        f"loss_fn.reference_policy_kl_penalty={KL_BETA}",
        f"policy.optimizer.kwargs.lr={lr}",
        "policy.scheduler.name=constant",
        "policy.max_grad_norm=1.0",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "logger.num_train_samples_to_log=0",
        "cluster.torch_num_threads=1",
        "cluster.device=cpu",
    ]


#: `--relayrl-trainer`: the overrides that select each trainer (legacy: grpo_train, driver-held batches; sync: the
#: data-plane trainer; async: the data-plane trainer with generation one step ahead, max_trajectory_age_steps=1, its
#: engine in a child process with its own thread, so relayrl has the machine's 2 cores as TRL with 2 threads has).
TRAINERS: dict[str, list[str]] = {
    "legacy": ["data_plane.enabled=false"],
    "sync": ["data_plane.enabled=true"],
    "async": ["data_plane.enabled=true", "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1"],
}


def run_relayrl(
    model_dir: str,
    total_steps: int,
    lr: float,
    work_dir: Path,
    extra: list[str] | None = None,
    trainer: str = "legacy",
    precision: str = "float32",
) -> dict[str, Any]:
    """relayrl through its public set-up and the trainer the config selects; step ends are taken when the loop
    logs `timing/train`. The legacy trainer's engine and policy calls are CPU-timed by phase as well."""
    import torch

    from relayrl.algorithms.setup import setup, train_components
    from relayrl.utils.config_io import load_config

    torch.set_num_threads(1)
    overrides = relayrl_overrides(model_dir, total_steps, lr, precision) + TRAINERS[trainer] + list(extra or [])
    cfg = load_config(None, overrides)
    run_dir = work_dir / "relayrl_run"
    c = setup(cfg, run_dir)
    meter = StepMeter()
    log_metrics = c.logger.log_metrics

    def clocked(metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        if prefix == "timing/train":
            meter.end_step()
        log_metrics(metrics, step, prefix=prefix)

    c.logger.log_metrics = clocked
    if trainer == "legacy":  # the async producer has its own engine (in another process): phases come from metrics
        meter.wrap(c.policy_generation, "generate", "generation")
        meter.wrap(c.policy, "get_logprobs", "logprobs")
        meter.wrap(c.policy, "get_reference_policy_logprobs", "logprobs")
        meter.wrap(c.policy, "train", "train")
    meter.start()
    try:
        train_components(cfg, c)
    finally:
        c.close()
    by_step: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            by_step.setdefault(int(row["step"]), {}).update(row)
    steps = [by_step[s] for s in sorted(by_step)]
    meter.rec["gen_tokens"] = [_gen_tokens(r) for r in steps]
    meter.rec["phases"] = {k: [float(r[k]) for r in steps if k in r] for k in _timing_keys(steps)}
    return meter.rec


def _timing_keys(steps: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in steps for k in r if k.startswith("timing/train/")})


def _gen_tokens(row: dict[str, Any]) -> float:
    """Generated tokens in the step, from the rollout metrics (mean per sample x samples)."""
    value = row.get("train/mean_gen_tokens_per_sample")
    return float("nan") if value is None else float(value) * NUM_PROMPTS * NUM_GENERATIONS


# ---------------------------------------------------------------------------------------------------- driver
def run_worker(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"bench_{args.worker}_") as tmp:
        total = args.steps + args.warmup
        if args.worker == "trl":
            rec = run_trl(args.model_dir, total, args.lr, Path(tmp), args.threads, args.run_precision)
        else:
            extra, trainer = args.relayrl_override, args.relayrl_trainer
            rec = run_relayrl(args.model_dir, total, args.lr, Path(tmp), extra, trainer, args.run_precision)
    rec["load_start"], rec["load_end"] = load, os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(rec))


def spawn(
    kind: str, model_dir: str, args: argparse.Namespace, out: Path, threads: int = 1, precision: str = "float32"
) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--worker", kind, "--model-dir", model_dir, "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr), "--threads", str(threads)]
    cmd += ["--relayrl-trainer", args.relayrl_trainer, "--run-precision", precision]
    for item in args.relayrl_override:
        cmd += ["--relayrl-override", item]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{kind} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _steady(runs: list[dict[str, Any]], key: str, warmup: int) -> list[float]:
    """Every run's values after its warm-up steps, pooled."""
    return [x for r in runs for x in r[key][warmup:]]


def _cpu_phase_rows(runs: list[dict[str, Any]], warmup: int, trl: bool) -> list[dict[str, float]]:
    """Per steady step: CPU seconds of generation, scoring + log-prob passes, training and the rest."""
    out = []
    for ph in (p for r in runs for p in r["cpu_phases"][warmup:]):
        gen, step = ph.get("generation", 0.0), ph["step"]
        if trl:  # TRL's rollout covers sampling, reward, reference log-probs and advantages; the rest is training
            row = {"generation": gen, "logprobs": ph.get("rollout", 0.0) - gen, "train": step - ph.get("rollout", 0.0)}
            row["other"] = 0.0
        else:
            row = {"generation": gen, "logprobs": ph.get("logprobs", 0.0), "train": ph.get("train", 0.0)}
            row["other"] = step - sum(row.values())
        out.append({**row, "step": step})
    return out


def summarize(name: str, runs: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Print one side's line and return its medians (wall, p10 wall, CPU seconds per step)."""
    steady = _steady(runs, "step_s", warmup)
    out = {
        "wall": median(steady),
        "p10": statistics.quantiles(steady, n=10)[0] if len(steady) > 1 else float("nan"),
        "cpu": median(_steady(runs, "cpu_s", warmup)),
    }
    per_run = ", ".join(f"{median(r['step_s'][warmup:]):.3f}" for r in runs)
    loads = ", ".join(f"{r['load_start']:.1f}->{r['load_end']:.1f}" for r in runs)
    print(
        f"{name:8s} step wall median {out['wall']:.3f} s (per run {per_run}; p10 {out['p10']:.3f} s) over "
        f"{len(steady)} steady steps | CPU {out['cpu']:.3f} s/step | generated tokens/step median "
        f"{median(_steady(runs, 'gen_tokens', warmup)):.0f} | 1-min load {loads}"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steady steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="leading steps discarded per run")
    p.add_argument("--rounds", type=int, default=2, help="TRL/relayrl alternations")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--relayrl-override", action="append", default=[], metavar="KEY=VALUE", help="extra relayrl override (repeat)"
    )
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES), help="tiny (0.56M) or 25m parameters")
    p.add_argument(
        "--trl-threads",
        type=int,
        nargs="*",
        default=[1, 2],
        help="TRL runs at each; its fastest is the comparison (none: relayrl alone)",
    )
    p.add_argument(
        "--relayrl-trainer", default="async", choices=sorted(TRAINERS), help="relayrl trainer (see TRAINERS)"
    )
    p.add_argument(
        "--precision",
        nargs="+",
        default=["float32"],
        choices=PRECISIONS,
        help="run both sides in each (relayrl policy.precision, TRL bf16=True); ratios per precision and between",
    )
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--run-precision", default="float32", choices=PRECISIONS, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["trl", "relayrl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return

    with tempfile.TemporaryDirectory(prefix="bench_trl_vs_relayrl_") as tmp:
        model_dir = str(Path(tmp) / "tiny-qwen2")
        n_params = build_model_dir(Path(model_dir), args.model_size)
        from relayrl.models.fast.kernels import load_cpu_kernels

        load_cpu_kernels()  # build relayrl's compiled CPU kernels now (cached), not inside a timed run
        flops_per_token, prompt_tokens = matmul_flops_per_token(model_dir)
        peak = gemm_peak_gflops(MODEL_SIZES[args.model_size].get("hidden_size", 128))
        dims = ", ".join(f"{k}={v}" for k, v in MODEL_SIZES[args.model_size].items())
        print(f"model: random Qwen2 ({args.model_size}: {dims}), {n_params:,} params; ", end="")
        print(f"{NUM_PROMPTS}x{NUM_GENERATIONS} per step, ")
        print(f"  <= {MAX_NEW_TOKENS} new tokens, beta {KL_BETA}, lr {args.lr}; precisions {args.precision}; ", end="")
        print(f"TRL threads {args.trl_threads}, relayrl {args.relayrl_trainer} (1 thread per side); ", end="")
        print(f"{args.rounds} rounds x {args.steps} steady steps (+{args.warmup} warm-up) each")
        sides = [(f"trl{t}", "trl", t) for t in args.trl_threads] + [("relayrl", "relayrl", 1)]
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in range(args.rounds):  # precisions and sides interleaved: load from other processes hits all alike
            for prec in args.precision:
                for name, kind, threads in sides:
                    rec = spawn(kind, model_dir, args, Path(tmp) / f"{name}_{prec}_{r}.json", threads, prec)
                    runs.setdefault((name, prec), []).append(rec)
                    wall = median(rec["step_s"][args.warmup :])
                    print(f"round {r + 1} {prec:8s} {name:8s} median step {wall:.3f} s", flush=True)
    best: dict[tuple[str, str], dict[str, float]] = {}
    for prec in args.precision:
        print(f"\n== {prec}")
        best[("relayrl", prec)] = report_precision(args, runs, prec, (flops_per_token, prompt_tokens, peak))
        if args.trl_threads:
            by_threads = {t: summarize(f"TRL x{t}", runs[(f"trl{t}", prec)], args.warmup) for t in args.trl_threads}
            fastest = min(by_threads, key=lambda t: by_threads[t]["wall"])
            best[("trl", prec)] = by_threads[fastest]
            rl, trl = best[("relayrl", prec)], by_threads[fastest]
            print(
                f"ratio relayrl/TRL ({prec}, TRL at {fastest} threads): median step wall {rl['wall'] / trl['wall']:.3f}; "
                f"p10 wall {rl['p10'] / trl['p10']:.3f}; median CPU s/step {rl['cpu'] / trl['cpu']:.3f}"
                + ("" if args.relayrl_trainer == "legacy" else " (relayrl's generation process not counted)")
            )
    report_across_precisions(args, best)


PRECISIONS = ["float32", "bfloat16"]


def report_precision(
    args: argparse.Namespace, runs: dict[tuple[str, str], list[dict[str, Any]]], prec: str, floor_inputs: tuple
) -> dict[str, float]:
    """One precision's relayrl line, CPU phases and timing metrics (and the fp32 floor); returns relayrl's medians."""
    rl_runs = runs[("relayrl", prec)]
    rl = summarize(f"relayrl ({args.relayrl_trainer})", rl_runs, args.warmup)
    print("CPU s/step by phase, medians. TRL: logprobs = rollout - sampling (reference pass, reward, advantages),")
    print("  train = rest of step. relayrl: logprobs = prev + reference passes; other = reward, data, advantages, log")
    print(f"  {'':10s} {'generation':>10s} {'logprobs':>10s} {'train':>10s} {'other':>10s} {'step':>10s}")
    sides = [(f"trl{t}", True) for t in args.trl_threads]
    if args.relayrl_trainer == "legacy":  # async: phases overlap
        sides.append(("relayrl", False))
    for name, trl in sides:
        rows = _cpu_phase_rows(runs[(name, prec)], args.warmup, trl=trl)
        cols = [median([ph[k] for ph in rows]) for k in ("generation", "logprobs", "train", "other", "step")]
        print(f"  {name:10s} " + " ".join(f"{c:10.4f}" for c in cols))
    print("relayrl phases (median s, metrics.jsonl timing/train/*):")
    for key in sorted({k for r in rl_runs for k in r["phases"]}):
        vals = [x for r in rl_runs for x in r["phases"][key][args.warmup :]]
        print(f"  {key.removeprefix('timing/train/'):32s} {median(vals):.4f}")
    if prec == "float32":
        flops_per_token, prompt_tokens, peak = floor_inputs
        gen_tokens = median(_steady(rl_runs, "gen_tokens", args.warmup))
        floor = fp32_floor(flops_per_token, prompt_tokens, gen_tokens, peak, NUM_PROMPTS)
        print(
            f"fp32 floor of relayrl's step: {floor:.3f} s ({flops_per_token * 1e-6:.1f} MFLOP/token of linear layers, "
            f"{prompt_tokens}-token prompts, {gen_tokens:.0f} generated tokens; both cores at this core's measured "
            f"{peak:.0f} GFLOPS): {floor / rl['wall']:.2f} of relayrl's step"
        )
    return rl


def report_across_precisions(args: argparse.Namespace, best: dict[tuple[str, str], dict[str, float]]) -> None:
    """bf16 vs fp32 per side (relayrl's target: >= 1.6x), and relayrl/TRL with each side at its fastest precision."""
    print()
    if "float32" in args.precision and "bfloat16" in args.precision:
        for side in ("relayrl", "trl"):
            if (side, "float32") in best:
                f32, b16 = best[(side, "float32")], best[(side, "bfloat16")]
                speedup = f32["wall"] / b16["wall"]
                verdict = f" (target >= 1.6: {'PASS' if speedup >= 1.6 else 'FAIL'})" if side == "relayrl" else ""
                print(
                    f"{side} bf16 speed-up over fp32: median step wall {speedup:.2f}x{verdict}; "
                    f"median CPU s/step {f32['cpu'] / b16['cpu']:.2f}x"
                )
    if not args.trl_threads:
        return
    fastest = {s: min(args.precision, key=lambda p: best[(s, p)]["wall"]) for s in ("relayrl", "trl")}
    rl, trl = best[("relayrl", fastest["relayrl"])], best[("trl", fastest["trl"])]
    ratio = rl["wall"] / trl["wall"]
    print(
        f"ratio relayrl/TRL, each at its fastest precision (relayrl {fastest['relayrl']}, TRL {fastest['trl']}): "
        f"median step wall {ratio:.3f} (target <= 0.5: {'PASS' if ratio <= 0.5 else 'FAIL'}); "
        f"median CPU s/step {rl['cpu'] / trl['cpu']:.3f}"
    )
    if "float32" in args.precision:
        f32 = best[("relayrl", "float32")]["wall"] / best[("trl", "float32")]["wall"]
        print(f"ratio relayrl/TRL, fp32 vs fp32: median step wall {f32:.3f}")


if __name__ == "__main__":
    main()

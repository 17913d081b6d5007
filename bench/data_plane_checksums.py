"""What `data_plane.verify_checksums` costs a default step, side by side (issue 28, item 3).

Two parts:

1. Digest kernels on one default step's rollout put (128 rows of <= 64 tokens: int64 ids, float32 log-probs, bool
   mask, a dense float32 per-row field): relayrl's digest (`checksum.row_digests`, vectorised over the packed
   column) against `zlib.crc32` and `zlib.adler32` per row. Medians of `--reps` timings, microseconds per column.
2. The default run (`relayrl train` with the shipped config, validation and checkpoints off, 1 torch thread) with
   checksums on and off side by side: `--rounds` fresh subprocesses, each switching every client's checksums on
   and off at every step boundary (the store is empty there), starting on and off in turn, so the two arms share
   the process, the model's progress and the box's load. Per step: CPU seconds between consecutive step ends of
   the run's process and its children (all threads; the generation engine decodes in a child process) and the
   run's own `data_plane/all/checksum/cpu_ms` (every client's thread CPU time computing and verifying
   checksums). The first `--warmup` steps of each run are discarded. Prints medians and the on/off ratio.

Run (about 3 minutes on a 2-core CPU):

    HF_HUB_OFFLINE=1 python bench/data_plane_checksums.py --rounds 4 --steps 20
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
import zlib
from pathlib import Path
from typing import Any


def kernels(reps: int) -> None:
    import torch

    from relayrl.data_plane.checksum import row_digests
    from relayrl.data_plane.codec import Column

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(24, 65, (128,), generator=g)  # [N]
    t = int(lens.sum())
    cols = {
        "input_ids int64 jagged": Column(torch.randint(0, 100, (t,), generator=g), lens),
        "logprobs float32 jagged": Column(torch.randn(t, generator=g), lens),
        "token_mask bool jagged": Column(torch.rand(t, generator=g) > 0.5, lens),
        "sample_mask float32 dense": Column(torch.rand(128, generator=g)),
    }

    def per_row(fn: Any, col: Column) -> list[int]:
        data = col.values.numpy().tobytes()
        width = col.values.element_size() * (col.values[0].numel() if col.values.dim() > 1 else 1)
        ends = (torch.cumsum(col.lengths, 0) if col.lengths is not None else torch.arange(1, 129)).tolist()
        out, start = [], 0
        for end in ends:
            out.append(fn(data[start * width : end * width]))
            start = end
        return out

    kinds = {
        "relayrl digest": row_digests,
        "zlib.crc32/row": lambda c: per_row(zlib.crc32, c),
        "zlib.adler32/row": lambda c: per_row(zlib.adler32, c),
    }
    print(f"digest kernels, one default rollout put ({t} tokens, 128 rows), median us per column over {reps} reps")
    for name, col in cols.items():
        row = []
        for kind, fn in kinds.items():
            fn(col)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn(col)
                times.append((time.perf_counter() - start) * 1e6)
            row.append(f"{kind} {statistics.median(times):7.1f}")
        print(f"  {name:28s} " + " | ".join(row))


def run_worker(args: argparse.Namespace) -> None:
    """One default run in this process; the CPU clock at every step end and the run's metrics."""
    import psutil
    import torch

    from relayrl.algorithms.setup import run_training
    from relayrl.data_plane.proxy import ProxyClient
    from relayrl.utils import logger as logger_mod
    from relayrl.utils.config_io import load_config

    torch.set_num_threads(1)
    ends: list[tuple[float, bool]] = []  # (CPU clock at the step's end, checksums on during the step)
    state = {"on": args.worker == "on"}
    ProxyClient.verify_checksums = property(  # type: ignore[assignment,method-assign]
        lambda self: state["on"], lambda self, value: None
    )
    log_metrics = logger_mod.Logger.log_metrics
    me = psutil.Process()

    def cpu_now() -> float:
        total = time.process_time()  # this process, every thread, at full resolution
        for proc in me.children(recursive=True):  # the engine's child process, where one runs
            try:
                t = proc.cpu_times()
            except psutil.Error:  # a child that just ended
                continue
            total += t.user + t.system
        return total

    def clocked(self: Any, metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        log_metrics(self, metrics, step, prefix=prefix)
        if prefix == "timing/train":
            ends.append((cpu_now(), state["on"]))
            state["on"] = not state["on"]  # the next step runs with the other setting

    logger_mod.Logger.log_metrics = clocked  # type: ignore[method-assign]
    overrides = [
        f"grpo.max_num_steps={args.steps + args.warmup}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "cluster.torch_num_threads=1",
    ]
    cfg = load_config(None, overrides)
    with tempfile.TemporaryDirectory(prefix=f"bench_checksums_{args.worker}_") as tmp:
        run_training(cfg, Path(tmp) / "run")
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step: dict[int, dict[str, Any]] = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), {}).update(r)
    rec: dict[str, dict[str, list[float]]] = {"on": {}, "off": {}}
    for i in range(args.warmup, len(ends)):  # step i + 1
        arm, row = "on" if ends[i][1] else "off", by_step[i + 1]
        values = {
            "cpu": ends[i][0] - ends[i - 1][0],
            "checksum_ms": float(row.get("data_plane/all/checksum/cpu_ms", 0.0)),
            "data_plane_ms": float(row.get("data_plane/all/ms_total", 0.0)),
            "step_s": float(row["timing/train/total_step_time"]),
        }
        for k, v in values.items():
            rec[arm].setdefault(k, []).append(v)
    Path(args.out).write_text(json.dumps(rec))


def spawn(arm: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--worker", arm, "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{arm} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="on/off alternations")
    p.add_argument("--steps", type=int, default=10, help="steady steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="leading steps discarded per run (>= 1)")
    p.add_argument("--reps", type=int, default=200, help="timings per digest kernel")
    p.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)  # the first step's setting
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return run_worker(args)
    kernels(args.reps)
    runs: list[dict[str, dict[str, list[float]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            first = "on" if r % 2 == 0 else "off"
            runs.append(spawn(first, args, Path(tmp) / f"run{r}.json"))
    med = {
        arm: {k: statistics.median([x for run in runs for x in run[arm][k]]) for k in runs[0][arm]}
        for arm in ("on", "off")
    }
    n = {arm: sum(len(run[arm]["cpu"]) for run in runs) for arm in ("on", "off")}
    print(f"default run, {args.rounds} runs x {args.steps} steady steps alternating, medians per step:")
    for arm in ("off", "on"):
        m = med[arm]
        print(
            f"  checksums {arm:3s} ({n[arm]} steps): CPU {m['cpu']:.4f} s | wall {m['step_s']:.4f} s | data plane {m['data_plane_ms']:.2f}"
            f" ms | checksums {m['checksum_ms']:.2f} ms"
        )
    on, off = med["on"], med["off"]
    print(f"  CPU s/step on/off: {on['cpu'] / off['cpu']:.4f}")
    print(f"  checksum ms / CPU ms per step (on): {on['checksum_ms'] / (on['cpu'] * 1e3):.4%}")


if __name__ == "__main__":
    main()

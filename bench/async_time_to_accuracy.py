"""Wall time to +30 validation points: the default config trained by sync and by async GRPO, side by side (issue 16,
items 6 and 7).

Why: async is only worth choosing if it learns as well per sample and reaches a target accuracy sooner. Both runs
use the default config unchanged (`relayrl train`: 1000 steps of 16 x 8 arithmetic rollouts, validation on 200
held-out problems every 50 steps) except the trainer: `sync` is the default data-plane trainer, `async` adds
`grpo.async_grpo.enabled=true` (max_trajectory_age_steps 1, generation in its own process). Each run is a fresh
subprocess; rounds alternate sync and async so a shared box disturbs both alike.

For every validation the worker records the wall seconds since training started (set-up excluded: the same for
both) and the accuracy. Reported per trainer: the first validation at +30 points over the first one (step and
seconds), the final gain, and the gain at each validation step (equal samples: both trainers train on the same
number of rows per step). Medians over rounds.

Run (about 8 minutes per round on a quiet 2-core CPU):

    HF_HUB_OFFLINE=1 python bench/async_time_to_accuracy.py --rounds 1
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

TARGET_POINTS = 30.0
TRAINERS = {"sync": [], "async": ["grpo.async_grpo.enabled=true"]}


def run_worker(trainer: str, out: Path, extra: list[str]) -> None:
    """One default run; writes [(step, seconds since the first step began, accuracy)] per validation."""
    from relayrl.algorithms.setup import run_training
    from relayrl.utils import logger as logger_mod
    from relayrl.utils.config_io import load_config

    marks: list[tuple[int, float, float]] = []
    start: list[float] = []
    log_metrics = logger_mod.Logger.log_metrics

    def clocked(self: Any, metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        now = time.perf_counter()
        if prefix == "validation" and "accuracy" in metrics:
            marks.append((step, now - (start[0] if start else now), float(metrics["accuracy"])))
        if prefix == "timing/train" and not start:  # the first step's end: back-date by its duration
            start.append(now - float(metrics.get("total_step_time", 0.0)))
        log_metrics(self, metrics, step, prefix=prefix)

    logger_mod.Logger.log_metrics = clocked  # type: ignore[method-assign]
    cfg = load_config(None, [*TRAINERS[trainer], "logger.progress_bar=false", *extra])
    with tempfile.TemporaryDirectory(prefix=f"tta_{trainer}_") as tmp:
        run_training(cfg, Path(tmp) / "run")
    # the validation before step 1 was logged before any step began: it is at time 0
    out.write_text(json.dumps([(s, max(t, 0.0) if s > 0 else 0.0, a) for s, t, a in marks]))


def first_reaching(marks: list[list[float]], points: float) -> tuple[int, float] | None:
    """(step, seconds) of the first validation `points` above the first one, or None."""
    base = marks[0][2]
    for step, seconds, acc in marks:
        if 100.0 * (acc - base) >= points - 1e-9:
            return int(step), float(seconds)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="applied to both trainers")
    p.add_argument("--points", type=float, default=TARGET_POINTS)
    p.add_argument("--worker", choices=sorted(TRAINERS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return run_worker(args.worker, Path(args.out), args.override)
    runs: dict[str, list[list[list[float]]]] = {t: [] for t in TRAINERS}
    with tempfile.TemporaryDirectory(prefix="tta_") as tmp:
        for r in range(args.rounds):
            for trainer in TRAINERS:
                out = Path(tmp) / f"{trainer}_{r}.json"
                cmd = [sys.executable, __file__, "--worker", trainer, "--out", str(out)]
                cmd += [x for o in args.override for x in ("--override", o)]
                env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"{trainer} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
                runs[trainer].append(json.loads(out.read_text()))
                hit = first_reaching(runs[trainer][-1], args.points)
                print(f"round {r + 1} {trainer:5s}: +{args.points:g} points at {hit} (step, s); load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    report: dict[str, Any] = {}
    for trainer, marks in runs.items():
        hits = [first_reaching(m, args.points) for m in marks]
        secs = [h[1] for h in hits if h is not None]
        steps = [h[0] for h in hits if h is not None]
        report[trainer] = {
            "reached": f"{len(secs)}/{len(marks)}",
            "step": statistics.median(steps) if steps else None,
            "seconds": statistics.median(secs) if secs else None,
            "final_gain_points": statistics.median(100.0 * (m[-1][2] - m[0][2]) for m in marks),
            "train_seconds": statistics.median(m[-1][1] for m in marks),
            "gain_by_step": {int(s): round(100.0 * (a - marks[0][0][2]), 1) for s, _, a in marks[0]},
            "seconds_by_step": {int(s): round(t, 1) for s, t, _ in marks[0]},
        }
    print(json.dumps(report, indent=1))
    s, a = report["sync"], report["async"]
    if s["seconds"] and a["seconds"]:
        print(f"time to +{args.points:g} points: sync {s['seconds']:.1f} s (step {s['step']}), async "
              f"{a['seconds']:.1f} s (step {a['step']}): async/sync {a['seconds'] / s['seconds']:.2f}")  # fmt: skip
    print(f"final gain: sync {s['final_gain_points']:+.1f}, async {a['final_gain_points']:+.1f} points; "
          f"training wall: sync {s['train_seconds']:.1f} s, async {a['train_seconds']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()

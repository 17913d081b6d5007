"""What the flight recorder costs on the default run (issue 18: at most 5% of step time).

The embedded default config (the shipped model, 16 prompts x 8 generations, data-plane trainer) trains `--steps`
steps without validation, once with `logger.flight_recorder.enabled=true` (every step recorded, the default) and
once with it off; rounds alternate the order so load from other processes hits both alike. Each run is a fresh
subprocess; its first `--warmup` steps are dropped. Reported, as medians over the kept steps of all rounds:

    step_s      timing/train/total_step_time, recorder on and off, and their ratio
    record_s    timing/train/flight_recorder (the recorder's own time inside the step) and its share of the step

The share is the direct measure (same run, same steps); the on/off ratio also includes run-to-run noise.

    HF_HUB_OFFLINE=1 python bench/flight_recorder.py [--steps 30] [--rounds 2] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(run_dir: Path, steps: int, recorder: bool) -> dict[int, dict[str, float]]:
    """Train in a subprocess; return the timing metrics per step."""
    argv = [
        sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir),
        f"grpo.max_num_steps={steps}", "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0",
        "checkpointing.enabled=false", "logger.tensorboard_enabled=false", "logger.progress_bar=false",
        f"logger.flight_recorder.enabled={str(recorder).lower()}",
    ]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if k.startswith("timing/train/")})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    step_s: dict[bool, list[float]] = {True: [], False: []}
    record_s: list[float] = []
    files: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for recorder in [True, False] if r % 2 == 0 else [False, True]:
                run_dir = Path(tmp) / f"r{r}_{'on' if recorder else 'off'}"
                timing = run_once(run_dir, args.steps, recorder)
                kept = [timing[s] for s in sorted(timing) if s > args.warmup]
                step_s[recorder] += [t["timing/train/total_step_time"] for t in kept]
                if recorder:
                    record_s += [t["timing/train/flight_recorder"] for t in kept]
                    files += [f.stat().st_size for f in (run_dir / "rollouts").glob("*.parquet")]
    on, off, rec = (statistics.median(step_s[True]), statistics.median(step_s[False]), statistics.median(record_s))
    result = {
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "kept_steps_per_side": len(step_s[True]),
        "median_step_s_recorder_on": round(on, 4),
        "median_step_s_recorder_off": round(off, 4),
        "step_time_ratio_on_over_off": round(on / off, 4),
        "median_record_s": round(rec, 5),
        "record_share_of_step": round(rec / on, 4),
        "median_file_kib": round(statistics.median(files) / 1024, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

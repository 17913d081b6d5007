"""Does GRPO teach the shipped model to use its tool? The learning measurement of the tool-use task (issue 26, item 6).

Runs `relayrl train --config configs/grpo_tool_multiply.yaml` (two-digit multiplication with a `multiply` tool on
the half-trained `builtin:tiny-calc`) as a subprocess on `--threads` intra-op threads, follows its metrics.jsonl,
and stamps every validation (greedy, the 200 held-out products) with the wall and CPU seconds since launch (set-up
included: loading, the first validation). Prints the held-out success at the start and at each validation, the
first validation at +`--target` points and when it came, and the run's totals; the run directory keeps the
metrics (`relayrl plot RUN` draws them, tool-call validity, turns and tool latency included).

The box may be shared: the load average before and after is printed, and CPU seconds are the process's own (its
threads and children), which other processes do not inflate the way they inflate wall time.

    HF_HUB_OFFLINE=1 python bench/tool_task_learning.py --run-dir runs/tool_task
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_tool_multiply.yaml"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its waited-for children, from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return float("nan")
    return sum(int(fields[k]) for k in (11, 12, 13, 14)) / TICKS  # utime, stime, cutime, cstime


def validations(metrics: Path) -> dict[int, float]:
    """{step: validation/accuracy} logged so far (a partly written last line is skipped)."""
    out: dict[int, float] = {}
    if not metrics.is_file():
        return out
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "validation/accuracy" in row:
            out[int(row["step"])] = float(row["validation/accuracy"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, required=True, help="a new directory for the run")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (OMP_NUM_THREADS) of the run")
    p.add_argument("--target", type=float, default=20.0, help="points of held-out success to reach")
    p.add_argument("--budget-s", type=float, default=600.0, help="wall seconds the target must be reached within")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for the run")
    args = p.parse_args(argv)
    if args.run_dir.exists():
        p.error(f"--run-dir {args.run_dir} exists; give a new directory")
    args.run_dir = args.run_dir.resolve()  # the run starts in the repository root
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "relayrl.cli.main", "train", "--config", str(CONFIG), "--run-dir", str(args.run_dir)]
    cmd += ["logger.progress_bar=false", *args.overrides]
    print("command:", " ".join(cmd[1:]), f"(OMP_NUM_THREADS={args.threads})", flush=True)
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    stamps: dict[int, tuple[float, float, float]] = {}  # step -> (accuracy, wall s, CPU s)
    cpu = 0.0
    while True:
        done = proc.poll() is not None
        now = time.perf_counter() - start
        if not done:
            cpu = cpu_seconds(proc.pid)
        for step, acc in validations(args.run_dir / "metrics.jsonl").items():
            if step not in stamps:
                stamps[step] = (acc, now, cpu)
                print(f"step {step:4d}  held-out success {acc:.3f}  wall {now:6.1f} s  CPU {cpu:6.1f} s", flush=True)
        if done:
            break
        time.sleep(0.5)
    wall = time.perf_counter() - start
    rusage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total_cpu = rusage.ru_utime + rusage.ru_stime
    if proc.returncode != 0 or not stamps:
        print(f"the run failed (exit {proc.returncode}); see {args.run_dir}")
        return 1
    steps = sorted(stamps)
    first, last = stamps[steps[0]][0], stamps[steps[-1]][0]
    reached = next((s for s in steps if (stamps[s][0] - first) * 100 >= args.target), None)
    print(f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} (1 min; {os.cpu_count()} CPUs)")
    print(
        f"held-out success: start {first:.3f} -> end {last:.3f} ({(last - first) * 100:+.1f} points) at step "
        f"{steps[-1]}; run wall {wall:.1f} s, CPU {total_cpu:.1f} s"
    )
    if reached is None:
        print(f"+{args.target:g} points: not reached")
        return 1
    acc, at_wall, at_cpu = stamps[reached]
    verdict = "within" if at_wall <= args.budget_s else "NOT within"
    print(
        f"+{args.target:g} points: first at step {reached} ({acc:.3f}), wall {at_wall:.1f} s, CPU {at_cpu:.1f} s "
        f"since launch: {verdict} {args.budget_s:g} s"
    )
    return 0 if at_wall <= args.budget_s else 1


if __name__ == "__main__":
    sys.exit(main())

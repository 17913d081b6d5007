"""`relayrl replay RUN_DIR --from-step N [--to-step M] --out DIR [overrides]`: train again on a run's recorded
rollouts (its flight recorder files) from its step N − 1 checkpoint, without generating; writes DIR/metrics.jsonl
and says whether the replayed training metrics equal the recorded ones."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from relayrl.cli.common import fail
from relayrl.utils.config_io import ConfigError


def add_parser(sub: Any) -> None:
    r = sub.add_parser("replay", help="re-run a run's training steps on its recorded rollouts (no generation)")
    r.add_argument("run_dir")
    r.add_argument("--from-step", type=int, required=True, help="first step to replay (needs checkpoint step_N-1)")
    r.add_argument("--to-step", type=int, help="last step to replay (default: --from-step)")
    r.add_argument("--out", required=True, help="directory for the replay (metrics.jsonl, config.yaml)")
    r.add_argument("overrides", nargs="*", help="config changes to replay with, right after RUN_DIR")
    r.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config change (repeatable), anywhere"
    )
    r.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    run_dir, out = Path(args.run_dir), Path(args.out)
    overrides = [*args.overrides, *args.set]
    if not (run_dir / "config.yaml").is_file():
        return fail(f"{run_dir} is not a run directory (no config.yaml)")
    if out.exists() and any(out.iterdir()):
        return fail(f"--out {out} exists and is not empty; name a new directory")
    from relayrl.algorithms.logprob_error import LogprobErrorAlarm
    from relayrl.algorithms.replay import replay_run
    from relayrl.algorithms.setup import SetupError
    from relayrl.distributed.refit_digest import RefitVerificationError

    try:
        report = replay_run(run_dir, args.from_step, args.to_step, out, overrides)
    except (ConfigError, SetupError, FileNotFoundError, ValueError, KeyError) as exc:
        return fail(str(exc).strip("'\""))
    except (LogprobErrorAlarm, RefitVerificationError) as exc:  # a fault in a replayed step: one line, exit 1
        print(f"relayrl: error: {exc}", file=sys.stderr)
        return 1
    steps = f"{report.steps[0]}..{report.steps[-1]}"
    print(f"replayed steps {steps} of {run_dir} -> {report.metrics_path}")
    if args.overrides:
        print(
            f"with overrides: {' '.join(args.overrides)} ({len(report.mismatches)} of {report.compared} values differ)"
        )
    elif report.mismatches:
        print(f"{len(report.mismatches)} of {report.compared} train/* values differ from the recorded run:")
    else:
        print(f"all {report.compared} train/* values equal the recorded run's")
    if report.legacy:
        print("(the run used the legacy trainer: replayed on the data-plane trainer, byte counters not compared)")
    for step, name, recorded, replayed in report.mismatches[:10]:
        print(f"  step {step}  {name:<40} recorded {recorded!r:<24} replayed {replayed!r}")
    return 0

"""`relayrl diff RUN_A RUN_B`: the first step and metric where two runs diverge, and (where both recorded that step)
the first sample and column; "identical" and exit 0 when every metric of their common steps is equal.

Metrics that measure time (timings, throughput, latencies) differ between any two runs and are never compared;
sample keys are random per run and are skipped in the sample comparison. Transport counters (the data plane's bytes,
operation counts and occupancy, the driver's byte accounting) are left out too unless `--all` is given: they say how
data moved, not what was trained, and with async GRPO they depend on when the producer ran.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from relayrl.cli.common import fail
from relayrl.utils.jsonl import JsonlError, read_jsonl

EXIT_DIFFERENT = 1
_SKIP_COLUMNS = ("sample_key", "tool_latency_s")  # keys and timings differ between equal runs


def add_parser(sub: Any) -> None:
    d = sub.add_parser("diff", help="first step, metric and sample where two runs diverge")
    d.add_argument("run_a")
    d.add_argument("run_b")
    d.add_argument("--rows", type=int, default=8, help="differing metrics shown at the first divergent step")
    d.add_argument(
        "--all",
        dest="include_transport",
        action="store_true",
        help="also compare transport counters (data_plane/*, the driver's byte accounting); timings never",
    )
    d.set_defaults(handler=run)


def is_timed(name: str) -> bool:
    """Metrics of wall-clock time or rates over it: they differ between identical runs."""
    return (
        name.startswith(("timing/", "performance/", "refit/"))
        or name.endswith(("tokens_per_sec", "_time", "share_of_step", "latency_s"))  # latency_s: tool calls
        or "/ms_" in name
        or "_ms" in name.rsplit("/", 1)[-1]
    )


def is_transport(name: str) -> bool:
    """Counters of how data moved (bytes, operations, occupancy), not of what was trained."""
    return name.startswith("data_plane/") or name.startswith("train/driver_") or name.endswith("_bytes_written")


def load_metrics(run_dir: Path, *, include_transport: bool = True) -> dict[int, dict[str, Any]]:
    """metrics.jsonl merged by step, each step's names in logged order (time-based metrics left out, and transport
    counters unless `include_transport`)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; is it a run directory?")
    out: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(path):
        step = int(row.pop("step"))
        kept = {k: v for k, v in row.items() if not is_timed(k) and (include_transport or not is_transport(k))}
        out.setdefault(step, {}).update(kept)
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def first_metric_divergence(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> tuple[int, list[str]] | None:
    """(step, differing metric names) at the first common step that differs, else None."""
    for step in sorted(set(a) & set(b)):
        names = list(dict.fromkeys([*a[step], *b[step]]))
        bad = [n for n in names if n not in a[step] or n not in b[step] or not same(a[step][n], b[step][n])]
        if bad:  # training metrics first, then validation, then the rest (byte counters...), each in logged order
            rank = {"train": 0, "validation": 1}
            return step, sorted(bad, key=lambda n: rank.get(n.split("/", 1)[0], 2))
    return None


def first_sample_divergence(run_a: Path, run_b: Path, step: int) -> tuple[int, str, Any, Any] | None:
    """(row, column, value in A, value in B) of the first differing cell of the step's recordings, None when both
    recorded it identically; raises FileNotFoundError when either run did not record it."""
    from relayrl.data_plane.recorder import ROLLOUTS_DIR, read_step

    ta, tb = read_step(run_a / ROLLOUTS_DIR, step), read_step(run_b / ROLLOUTS_DIR, step)
    columns = [c for c in dict.fromkeys([*ta.column_names, *tb.column_names]) if c not in _SKIP_COLUMNS]
    values = {
        c: (
            ta.column(c).to_pylist() if c in ta.column_names else None,
            tb.column(c).to_pylist() if c in tb.column_names else None,
        )
        for c in columns
    }
    for row in range(max(ta.num_rows, tb.num_rows)):
        for c in columns:
            va, vb = values[c]
            x = va[row] if va is not None and row < len(va) else "<missing>"
            y = vb[row] if vb is not None and row < len(vb) else "<missing>"
            if not same(x, y):
                return row, c, x, y
    return None


def _short(value: Any, width: int = 28) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def run(args: argparse.Namespace) -> int:
    run_a, run_b = Path(args.run_a), Path(args.run_b)
    try:
        a = load_metrics(run_a, include_transport=args.include_transport)
        b = load_metrics(run_b, include_transport=args.include_transport)
    except (FileNotFoundError, JsonlError) as exc:
        return fail(str(exc))
    common = sorted(set(a) & set(b))
    if not common:
        return fail(f"{run_a} and {run_b} have no step in common to compare")
    found = first_metric_divergence(a, b)
    if found is None:
        extra = "" if set(a) == set(b) else f" (run A logged {len(a)} steps, run B {len(b)})"
        print(f"identical: {len(common)} common steps ({common[0]}..{common[-1]}), every metric equal{extra}")
        return 0
    step, names = found
    print(f"first divergence: step {step}, metric {names[0]} ({len(names)} metrics differ at that step)")
    width = max(len(n) for n in names[: args.rows])
    print(f"  {'metric':<{width}}  {'run A':<28}  {'run B':<28}")
    for n in names[: args.rows]:
        print(f"  {n:<{width}}  {_short(a[step].get(n, '<absent>')):<28}  {_short(b[step].get(n, '<absent>')):<28}")
    try:
        cell = first_sample_divergence(run_a, run_b, step)
    except FileNotFoundError:
        print(f"  (no flight recording of step {step} in both runs: samples not compared)")
        return EXIT_DIFFERENT
    except ValueError as exc:  # a damaged recording (RecordingDamagedError names the file)
        print(f"  ({exc}: samples not compared)")
        return EXIT_DIFFERENT
    if cell is None:
        print(f"  the recorded samples of step {step} are identical")
    else:
        row, column, x, y = cell
        print(
            f"  first differing sample of step {step}: row {row}, column {column}: {_short(x, 60)} vs {_short(y, 60)}"
        )
    return EXIT_DIFFERENT

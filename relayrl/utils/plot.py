"""Turn a run's metrics.jsonl into one PNG of training curves (`relayrl` runs and `python -m relayrl.utils.plot`).

A run of environment classes (tool use) also gets tool-call validity, turns per episode and tool latency per call.
Below the curves, when the run logged them, a full-width stacked chart of each step's time by phase
(`timer.STEP_PHASES`, the remainder `unaccounted` on top, `total_step_time` as a line): what a step spent where.

Uses matplotlib's object API with the Agg canvas directly, so it never touches pyplot's global backend (safe in
headless jobs and inside notebooks alike).
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from relayrl.utils.timer import STEP_PHASES, TOTAL, UNACCOUNTED

#: (panel title, metric name) in display order; `critic/loss` only appears when the run logged it (PPO).
PANELS: list[tuple[str, str]] = [
    ("Reward", "train/reward"),
    ("Validation accuracy", "validation/accuracy"),
    ("KL penalty", "train/kl_penalty"),
    ("Loss", "train/loss"),
    ("Response length (tokens)", "train/mean_gen_tokens_per_sample"),
    ("Step time (s)", "timing/train/total_step_time"),
]
OPTIONAL_PANELS: list[tuple[str, str]] = [
    ("Value loss", "critic/loss"),
    ("Async producer idle (s)", "timing/async/producer_idle"),  # waiting for weights within the staleness bound
    ("Async queue depth (batches ready)", "timing/async/queue_depth"),
]
#: Drawn for a run that played environment classes (issue 26), per environment prefix (`train/env/`, or
#: `train/env/<name>/` with several): the share of tool calls that were valid (derived: `tool_calls` over
#: `tool_calls + invalid_tool_calls`), turns per episode, and the mean tool latency per call.
VALID_CALLS = "tool_call_validity"
TOOL_PANELS: list[tuple[str, str]] = [
    ("Tool-call validity (valid / all calls)", VALID_CALLS),
    ("Tool latency per call (s)", "tool_latency_s"),
]
TURNS_PANEL = ("Turns per episode", "train/avg_turns_per_sample")
TIMING_PREFIX = "timing/train/"
QUEUE_DEPTH = "timing/async/queue_depth"
#: The asynchronous producer's side, drawn under the breakdown (`--breakdown`) when the run logged it.
PRODUCER_KEYS = (
    "timing/async/producer_generation",
    "timing/async/producer_idle",
    "timing/async/producer_refit",
    QUEUE_DEPTH,
)
#: Bars up to this many steps; a stacked area beyond (bars of a long run would be thinner than a pixel).
MAX_BARS = 100


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Scalar series per metric name, sorted by step; a later line for the same step overrides an earlier one.

    A truncated final line (the run died mid-write) is skipped with a warning rather than failing the plot.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    series: dict[str, dict[int, float]] = {}
    rows = 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                warnings.warn(f"{path}:{lineno}: skipping unreadable line", stacklevel=2)
                continue
            rows += 1
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    series.setdefault(key, {})[step] = float(value)
    if rows == 0:
        raise ValueError(f"metrics file has no metric rows: {path}")
    return {k: sorted(v.items()) for k, v in series.items()}


def plot_run(run_dir: str | Path, out: str | Path | None = None, breakdown_only: bool = False) -> Path:
    """Plot `<run_dir>/metrics.jsonl` to `out` (default `<run_dir>/metrics.png`) and return the PNG path; with
    `breakdown_only`, just the stacked chart of each step's time by phase (ValueError if the run logged none)."""
    run_dir = Path(run_dir)
    series = read_metrics(run_dir / "metrics.jsonl")
    if breakdown_only:
        return _save(_breakdown_figure(run_dir, series), run_dir, out)
    panels = PANELS + [p for p in OPTIONAL_PANELS if p[1] in series] + tool_panels(series)
    phases = [p for p in (*STEP_PHASES, UNACCOUNTED) if TIMING_PREFIX + p in series]
    ncols = 2
    nrows = math.ceil(len(panels) / ncols)
    breakdown_h = 4.0 if phases else 0.0  # inches: the full-width breakdown row
    height = 3.2 * nrows + breakdown_h
    fig = Figure(figsize=(6 * ncols, height))
    FigureCanvasAgg(fig)
    # Fixed margins (in inches) rather than constrained layout, which doubles the rendering time.
    bottom = 0.5 + (1.0 if phases else 0.0)  # inches: x labels, and the breakdown's legend below its axes
    fig.subplots_adjust(left=0.07, right=0.98, bottom=bottom / height, top=1 - 0.8 / height, hspace=0.75, wspace=0.2)
    ratios = [3.2] * nrows + ([breakdown_h] if phases else [])
    grid = fig.add_gridspec(len(ratios), ncols, height_ratios=ratios)
    axes = [fig.add_subplot(grid[i // ncols, i % ncols]) for i in range(nrows * ncols)]
    if phases:
        _plot_breakdown(fig.add_subplot(grid[nrows, :]), series, phases)
    for ax, (title, key) in zip(axes, panels):
        ax.set_title(f"{title}\n{key}", fontsize=10)
        ax.set_xlabel("step")
        points = series.get(key)
        if not points:
            ax.text(0.5, 0.5, f"no data for {key}", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, linewidth=1.2)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"run: {run_dir.name}")
    return _save(fig, run_dir, out)


def tool_panels(series: dict[str, list[tuple[int, float]]]) -> list[tuple[str, str]]:
    """The tool-use panels of every environment prefix the run logged (`<prefix>episodes`), adding the derived
    validity series to `series`; none for a run without environment classes."""
    prefixes = sorted(
        k.removesuffix("episodes") for k in series if k.startswith("train/env/") and k.endswith("/episodes")
    )
    panels: list[tuple[str, str]] = []
    for prefix in prefixes:
        if prefix + VALID_CALLS not in series:  # runs logged before the environment logged it
            valid = dict(series.get(prefix + "tool_calls", []))
            invalid = dict(series.get(prefix + "invalid_tool_calls", []))
            calls = {s: valid.get(s, 0.0) + invalid.get(s, 0.0) for s in sorted({*valid, *invalid})}
            series[prefix + VALID_CALLS] = [(s, valid.get(s, 0.0) / n) for s, n in calls.items() if n > 0]
        panels += [(title, prefix + key) for title, key in TOOL_PANELS]
    return [TURNS_PANEL, *panels] if prefixes else []


def _save(fig: Figure, run_dir: Path, out: str | Path | None) -> Path:
    out_path = Path(out) if out is not None else run_dir / "metrics.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path


def _breakdown_figure(run_dir: Path, series: dict[str, list[tuple[int, float]]]) -> Figure:
    """The stacked chart alone; below it, for an asynchronous run, the producer's side (its generation and idle
    seconds per batch, and the queue the trainer found)."""
    phases = [p for p in (*STEP_PHASES, UNACCOUNTED) if TIMING_PREFIX + p in series]
    if not phases:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no {TIMING_PREFIX}<phase> timings to break a step down by")
    producer = [k for k in PRODUCER_KEYS if k in series]
    height = 5.2 + (3.0 if producer else 0.0)
    fig = Figure(figsize=(12, height))
    FigureCanvasAgg(fig)
    bottom = 0.5 if producer else 1.5  # inches: the legend sits under the breakdown (above the producer's axes)
    fig.subplots_adjust(left=0.07, right=0.93, bottom=bottom / height, top=1 - 0.8 / height, hspace=0.75)
    grid = fig.add_gridspec(2 if producer else 1, 1, height_ratios=[4.4, 2.6] if producer else [1])
    _plot_breakdown(fig.add_subplot(grid[0]), series, phases)
    if producer:
        _plot_producer(fig.add_subplot(grid[1]), series, producer)
    fig.suptitle(f"run: {run_dir.name}")
    return fig


def _plot_breakdown(ax: Axes, series: dict[str, list[tuple[int, float]]], phases: list[str]) -> None:
    """Each step's phases stacked (a step that did not run a phase gets 0 for it), `total_step_time` over them. A
    phase keeps its colour from run to run (its place in STEP_PHASES)."""
    by_phase = {p: dict(series[TIMING_PREFIX + p]) for p in phases}
    steps = sorted({s for values in by_phase.values() for s in values})
    tab20 = colormaps["tab20"].colors  # pairs of a dark and a light shade: the dark ones first, then the light
    palette = [tab20[(2 * i) % 20 + (2 * i) // 20] for i in range(20)]
    order = [*STEP_PHASES, UNACCOUNTED]
    colors = [palette[order.index(p) % len(palette)] for p in phases]
    stacks = [[max(by_phase[p].get(s, 0.0), 0.0) for s in steps] for p in phases]
    if len(steps) <= MAX_BARS:
        bottom = [0.0] * len(steps)
        for name, heights, color in zip(phases, stacks, colors):
            ax.bar(steps, heights, 0.8, bottom=bottom, label=name, color=color, linewidth=0)
            bottom = [b + h for b, h in zip(bottom, heights)]
    else:
        ax.stackplot(steps, stacks, labels=phases, colors=colors)
    total = series.get(TIMING_PREFIX + TOTAL)
    if total:
        ax.plot(*zip(*total), color="black", linewidth=1.0, marker=".", markersize=3, label=TOTAL)
    ax.set_title(f"Step time by phase (s)\n{TIMING_PREFIX}<phase>, stacked", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncols=min(7, len(phases) + 1), loc="upper center", bbox_to_anchor=(0.5, -0.2))


def _plot_producer(ax: Axes, series: dict[str, list[tuple[int, float]]], keys: list[str]) -> None:
    """The asynchronous producer's seconds per batch (lines) and the trainer's queue depth (steps, right axis)."""
    for key in keys:
        if key != QUEUE_DEPTH:
            ax.plot(*zip(*series[key]), marker=".", markersize=3, linewidth=1.0, label=key.removeprefix("timing/"))
    ax.set_ylabel("s")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.set_title("Async producer per batch (s) and the queue the trainer found", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    if QUEUE_DEPTH in keys:
        depth = ax.twinx()
        (line,) = depth.step(*zip(*series[QUEUE_DEPTH]), where="mid", color="black", linewidth=1.0)
        depth.set_ylabel("batches ready")
        handles, labels = [*handles, line], [*labels, QUEUE_DEPTH.removeprefix("timing/")]
    ax.legend(handles, labels, fontsize=8, loc="upper right")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot a relayrl run's metrics.jsonl to a PNG.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=None, help="output PNG (default <run_dir>/metrics.png)")
    parser.add_argument("--breakdown", action="store_true", help="only the stacked chart of each step's time by phase")
    args = parser.parse_args(argv)
    print(plot_run(args.run_dir, args.out, breakdown_only=args.breakdown))


if __name__ == "__main__":
    main()

"""Turn a run's metrics.jsonl into one PNG of training curves (`relayrl` runs and `python -m relayrl.utils.plot`).

Uses matplotlib's object API with the Agg canvas directly, so it never touches pyplot's global backend (safe in
headless jobs and inside notebooks alike).
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: (panel title, metric name) in display order; `critic/loss` only appears when the run logged it (PPO).
PANELS: list[tuple[str, str]] = [
    ("Reward", "train/reward"),
    ("Validation accuracy", "validation/accuracy"),
    ("KL penalty", "train/kl_penalty"),
    ("Loss", "train/loss"),
    ("Response length (tokens)", "train/mean_gen_tokens_per_sample"),
    ("Step time (s)", "timing/train/total_step_time"),
]
OPTIONAL_PANELS: list[tuple[str, str]] = [("Value loss", "critic/loss")]


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


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Plot `<run_dir>/metrics.jsonl` to `out` (default `<run_dir>/metrics.png`) and return the PNG path."""
    run_dir = Path(run_dir)
    series = read_metrics(run_dir / "metrics.jsonl")
    panels = PANELS + [p for p in OPTIONAL_PANELS if p[1] in series]
    ncols = 2
    nrows = math.ceil(len(panels) / ncols)
    height = 3.2 * nrows
    fig = Figure(figsize=(6 * ncols, height))
    FigureCanvasAgg(fig)
    # Fixed margins (in inches) rather than constrained layout, which doubles the rendering time.
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / height, top=1 - 0.8 / height, hspace=0.75, wspace=0.2)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
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
    out_path = Path(out) if out is not None else run_dir / "metrics.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot a relayrl run's metrics.jsonl to a PNG.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=None, help="output PNG (default <run_dir>/metrics.png)")
    args = parser.parse_args(argv)
    print(plot_run(args.run_dir, args.out))


if __name__ == "__main__":
    main()

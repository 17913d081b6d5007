"""One logging call, many sinks: console progress, metrics.jsonl, TensorBoard, and optionally W&B / MLflow.

`metrics.jsonl` is the ground truth (plots and tests read it): one JSON object per `log_metrics` call, holding
`"step"` and the flattened metric names (`prefix/key`, nested dicts joined with `/`). A step usually spans
several calls (rollout metrics, then train metrics, then timings), so the same step appears on several lines;
readers merge lines by step. Non-finite floats are written as `NaN` / `Infinity` (Python's json reads them).

The console shows a live rich progress bar on a terminal; otherwise (or with `logger.progress_bar: false`) one
concise line per step, at most every `print_interval_s` seconds. Both advance when a step's
`timing/train/total_step_time` is logged, which the trainer does last in a step.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from relayrl.config import LoggerConfig
from relayrl.utils.checkpoint import to_plain
from relayrl.utils.jsonl import repair_tail

REWARD_KEY = "train/reward"
ACCURACY_KEY = "validation/accuracy"
STEP_TIME_KEY = "timing/train/total_step_time"


def flatten_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` with prefix "train" -> `{"train/a/b": 1}`."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten_metrics(value, name))
        else:
            out[name] = value
    return out


def as_scalar(value: Any) -> float | None:
    """A float for numbers, bools and one-element tensors/arrays; None for anything else (lists, strings...)."""
    if isinstance(value, bool | int | float):
        return float(value)
    if hasattr(value, "numel") and hasattr(value, "item"):  # torch.Tensor
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    if hasattr(value, "size") and hasattr(value, "item") and hasattr(value, "dtype"):  # numpy array / scalar
        return float(value.item()) if value.size == 1 and value.dtype.kind in "biuf" else None
    return None


#: JSONL files kept open between writes; the least recently written one is closed past this (a long run writes a
#: new val_data_step<N>.jsonl at every validation and would otherwise run out of file handles).
_MAX_OPEN_JSONL = 4


class Logger:
    """Fans every metric out to the enabled backends. Use as a context manager or call `close()`.

    `total_steps` sizes the progress bar and ETA; `start_step` is where a resumed run's bar starts.
    """

    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: str | Path,
        total_steps: int | None = None,
        start_step: int = 0,
        print_interval_s: float = 10.0,
        console: Console | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.print_interval_s = print_interval_s
        # Import the optional backends first, so a missing extra fails before any file or run is created.
        wandb = _require("wandb", "wandb") if cfg.wandb_enabled else None
        mlflow = _require("mlflow", "mlflow") if cfg.mlflow_enabled else None
        repair_tail(self.run_dir / "metrics.jsonl")  # a crash mid-append left a partial line: the next row starts anew
        self._metrics_file: TextIO | None = open(self.run_dir / "metrics.jsonl", "a")  # appended on resume
        self._jsonl_files: dict[str, TextIO] = {}
        self._skipped_warned: set[str] = set()
        self._closed = False
        self._write_failed = False  # a write raised: closing may fail again on its buffered tail

        self._tb = None
        if cfg.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._wandb = None
        if wandb is not None:
            wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, dir=str(self.run_dir))  # -> run_dir/wandb
            self._wandb = wandb
        self._mlflow = None
        if mlflow is not None:
            mlflow.set_tracking_uri(cfg.mlflow.tracking_uri or (self.run_dir / "mlflow").resolve().as_uri())
            mlflow.set_experiment(cfg.mlflow.experiment_name)
            mlflow.start_run(run_name=cfg.mlflow.run_name)
            self._mlflow = mlflow

        self._has_scalar_backend = any(b is not None for b in (self._tb, self._wandb, self._mlflow))
        # Console state: latest values shown on the bar / step line.
        self._console = console or Console()
        self._latest: dict[str, float] = {}
        self._step_times: deque[float] = deque(maxlen=20)
        self._last_step: int | None = None
        self._last_printed_step: int | None = None
        self._last_print_time = -math.inf
        self._progress: Progress | None = None
        if cfg.progress_bar and self._console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]step"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[stats]}"),
                console=self._console,
                auto_refresh=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self._progress.start()

    # ------------------------------------------------------------------ metrics
    def log_metrics(self, metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        """Log one batch of metrics at `step` to every backend (non-scalars go to metrics.jsonl only)."""
        flat = flatten_metrics(metrics, prefix)
        if not flat:
            return
        if self._metrics_file is not None:
            row = {"step": int(step), **{k: to_plain(v) for k, v in flat.items() if k != "step"}}
            self._append(self._metrics_file, json.dumps(row) + "\n", self.run_dir / "metrics.jsonl")
        scalars: dict[str, float] = {}
        for name, value in flat.items():
            scalar = as_scalar(value)
            if scalar is None:
                if self._has_scalar_backend and name not in self._skipped_warned:
                    self._skipped_warned.add(name)
                    warnings.warn(f"metric {name!r} is not a scalar; only metrics.jsonl records it", stacklevel=2)
            else:
                scalars[name] = scalar
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=step)
        if self._mlflow is not None and scalars:
            self._mlflow.log_metrics({k: v for k, v in scalars.items() if math.isfinite(v)}, step=step)
        self._update_console(scalars, step)

    def log_hyperparams(self, config: dict[str, Any]) -> None:
        """Record the run configuration (TensorBoard text, W&B config, MLflow params flattened with '.')."""
        plain = to_plain(config.model_dump(mode="json") if hasattr(config, "model_dump") else config)
        if self._tb is not None:
            self._tb.add_text("hyperparams", "```\n" + json.dumps(plain, indent=2) + "\n```", global_step=0)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.config.update(plain, allow_val_change=True)
        if self._mlflow is not None:
            params = {k.replace("/", "."): str(v)[:500] for k, v in flatten_metrics(plain).items()}
            items = list(params.items())
            for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
                self._mlflow.log_params(dict(items[i : i + 100]))

    def log_jsonl(self, rows: list[dict[str, Any]], filename: str) -> Path:
        """Append one JSON line per row to `<run_dir>/<filename>` (tensors become lists); return the path."""
        path = self.run_dir / filename
        f = self._jsonl_files.pop(filename, None)
        if f is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            repair_tail(path)
            f = open(path, "a")
            if len(self._jsonl_files) >= _MAX_OPEN_JSONL:  # one-shot files (val_data_stepN) must not pile up
                oldest = next(iter(self._jsonl_files))
                self._jsonl_files.pop(oldest).close()
        self._jsonl_files[filename] = f  # most recently used last
        self._append(f, "".join(json.dumps(to_plain(row)) + "\n" for row in rows), path)
        return path

    def _append(self, f: TextIO, text: str, path: Path) -> None:
        """Write and flush; a failed write (disk full, read-only) is an OSError naming `path`. Its unwritten tail
        stays buffered: `close` drops it quietly, the first error being the one that counts (a partial last line is
        dropped by the next reader)."""
        try:
            f.write(text)
            f.flush()
        except OSError as exc:
            self._write_failed = True
            raise OSError(exc.errno, exc.strerror, str(path)) from exc

    def print_message(self, message: str) -> None:
        """Print above the live progress bar (or plainly when there is none)."""
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False, soft_wrap=True)
        else:
            self._console.print(message, markup=False, highlight=False, soft_wrap=True)

    # ------------------------------------------------------------------ console
    def _update_console(self, scalars: dict[str, float], step: int) -> None:
        for key in (REWARD_KEY, ACCURACY_KEY):
            if key in scalars:
                self._latest[key] = scalars[key]
        if STEP_TIME_KEY not in scalars:
            return
        self._step_times.append(scalars[STEP_TIME_KEY])
        self._latest[STEP_TIME_KEY] = scalars[STEP_TIME_KEY]
        self._last_step = step
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=self._stats_text())
            self._progress.refresh()
            return
        now = time.monotonic()
        if now - self._last_print_time >= self.print_interval_s or step == self.total_steps:
            self._print_step_line(now)

    def _print_step_line(self, now: float) -> None:
        total = f"/{self.total_steps}" if self.total_steps else ""
        self._console.print(
            f"step {self._last_step}{total} | {self._stats_text()}", markup=False, highlight=False, soft_wrap=True
        )
        self._last_print_time = now
        self._last_printed_step = self._last_step

    def _stats_text(self) -> str:
        parts = []
        if REWARD_KEY in self._latest:
            parts.append(f"reward {self._latest[REWARD_KEY]:.4g}")
        if ACCURACY_KEY in self._latest:
            parts.append(f"val acc {self._latest[ACCURACY_KEY]:.4g}")
        if STEP_TIME_KEY in self._latest:
            parts.append(f"{self._latest[STEP_TIME_KEY]:.3g} s/step")
        eta = self.eta_seconds()
        if eta is not None:
            parts.append(f"ETA {_format_duration(eta)}")
        return " | ".join(parts)

    def eta_seconds(self) -> float | None:
        """Remaining steps x mean of the recent step times; None when unknown."""
        if not self.total_steps or not self._step_times or self._last_step is None:
            return None
        return max(self.total_steps - self._last_step, 0) * statistics.fmean(self._step_times)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Flush and close every backend (idempotent); prints the last step if its line was rate-limited."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        elif self._last_step is not None and self._last_printed_step != self._last_step:
            self._print_step_line(time.monotonic())
        for f in [self._metrics_file, *self._jsonl_files.values()]:
            if f is not None:
                try:
                    f.close()
                except OSError:
                    if not self._write_failed:
                        raise
        self._metrics_file = None
        self._jsonl_files.clear()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _require(module: str, extra: str) -> Any:
    """Import an optional backend, or fail naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"logger.{module}_enabled is true but {module} is not installed; install the extra: "
            f"pip install 'relayrl[{extra}]'"
        ) from e


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"

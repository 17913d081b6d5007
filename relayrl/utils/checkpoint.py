"""Crash-safe checkpoint directories, retention of the best ones, and the trainer's resumable counters.

Layout under `checkpoint_dir`:

    tmp_step_<N>/   being written; never read on resume, removed before re-use
    step_<N>/       complete: appears only through an atomic rename of a fully written, fsynced tmp_step_<N>
    old_step_<N>/   transient, while an existing step_<N> is being replaced (restored by the next manager)
    deleting_*/     transient, a pruned checkpoint renamed away before its files are removed
    latest_checkpoint_status.json

A crash at any moment therefore leaves the previous complete `step_<M>` as the latest checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from relayrl.config import CheckpointingConfig

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^tmp_step_(\d+)$")
_OLD_RE = re.compile(r"^old_step_(\d+)$")
_DELETING_PREFIX = "deleting_"
TRAINING_INFO = "training_info.json"
RUN_CONFIG = "config.yaml"
STATUS_FILE = "latest_checkpoint_status.json"


# ---------------------------------------------------------------------------------------------------- save state
@dataclass
class GRPOSaveState:
    """Counters restored on resume. `current_step` and `total_steps` already count the step just finished."""

    consumed_samples: int = 0
    current_step: int = 0
    current_epoch: int = 0
    total_steps: int = 0
    total_valid_tokens: int = 0
    val_reward: float | None = -99999999.0
    sampler_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_save_state(training_info: dict[str, Any] | None) -> GRPOSaveState:
    """Build the save state from a checkpoint's training_info (None/{} ⇒ a fresh run).

    Unknown keys (e.g. the ranking metric `val:accuracy`) are dropped and missing or null ones take their
    defaults (a step without validation may store `val_reward: null`), so checkpoints written by older or newer
    versions still load.
    """
    names = {f.name for f in fields(GRPOSaveState)}
    return GRPOSaveState(**{k: v for k, v in (training_info or {}).items() if k in names and v is not None})


# ---------------------------------------------------------------------------------------------------- manager
class CheckpointManager:
    """Creates, finalizes, ranks and prunes `step_<N>` directories (synchronously, on the calling thread)."""

    def __init__(self, cfg: CheckpointingConfig, checkpoint_dir: str | Path) -> None:
        self.cfg = cfg
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self._recover_interrupted_swaps()

    # ------------------------------------------------------------------ writing
    def init_tmp_checkpoint(
        self, step: int, training_info: dict[str, Any], run_config: dict[str, Any] | None = None
    ) -> Path:
        """Create a fresh `tmp_step_<step>/` holding training_info.json (and config.yaml); return its path.

        The caller then writes weights, optimizer and dataloader state into it and calls `finalize_checkpoint`.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        tmp = self.checkpoint_dir / f"tmp_step_{step}"
        if tmp.exists():  # left by a crashed save of this step
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        (tmp / TRAINING_INFO).write_text(json.dumps(to_plain(training_info), indent=2) + "\n")
        if run_config is not None:
            if hasattr(run_config, "model_dump"):
                run_config = run_config.model_dump(mode="json")
            (tmp / RUN_CONFIG).write_text(yaml.safe_dump(to_plain(run_config), sort_keys=False))
        return tmp

    def finalize_checkpoint(self, tmp_path: str | Path) -> Path:
        """Make `tmp_step_<N>` durable and visible as `step_<N>`, record it, then apply retention."""
        tmp_path = Path(tmp_path)
        m = _TMP_RE.match(tmp_path.name)
        if m is None or not tmp_path.is_dir():
            raise ValueError(f"not a temporary checkpoint directory: {tmp_path}")
        step = int(m.group(1))
        _fsync_tree(tmp_path)
        final = tmp_path.parent / f"step_{step}"
        if final.exists():
            # Re-saving a step (e.g. after resuming from it): swap so a complete step_N exists at every moment
            # except between the two renames, and the next manager restores old_step_N if we die right there.
            old = tmp_path.parent / f"old_step_{step}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp_path, final)
            _fsync_dir(final.parent)
            _delete_dir(old)
        else:
            os.replace(tmp_path, final)
            _fsync_dir(final.parent)
        self._write_status(step)
        self.remove_old_checkpoints()
        return final

    def _write_status(self, step: int) -> None:
        status = {"last_successful_ckpt_save_completion": time.time(), "last_checkpoint_step": step}
        tmp = self.checkpoint_dir / f".{STATUS_FILE}.tmp"
        with open(tmp, "w") as f:
            json.dump(status, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.checkpoint_dir / STATUS_FILE)

    def _recover_interrupted_swaps(self) -> None:
        """Put back an `old_step_N` whose replacement never landed; drop it if the replacement did.

        Also finishes deletions that a crash interrupted (`deleting_*` directories).
        """
        for p in self.checkpoint_dir.iterdir():
            if p.name.startswith(_DELETING_PREFIX) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                continue
            m = _OLD_RE.match(p.name)
            if m is None or not p.is_dir():
                continue
            final = self.checkpoint_dir / f"step_{m.group(1)}"
            if final.exists():
                shutil.rmtree(p)
            else:
                os.replace(p, final)

    # ------------------------------------------------------------------ reading
    def list_checkpoints(self) -> dict[int, Path]:
        """Complete checkpoints by step (only exact `step_<int>` directories)."""
        out: dict[int, Path] = {}
        if not self.checkpoint_dir.is_dir():
            return out
        for p in self.checkpoint_dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m is not None and p.is_dir():
                out[int(m.group(1))] = p
        return dict(sorted(out.items()))

    def get_latest_checkpoint_path(self) -> Path | None:
        """The complete checkpoint with the highest step, or None."""
        ckpts = self.list_checkpoints()
        return ckpts[max(ckpts)] if ckpts else None

    def get_best_checkpoint_path(self) -> Path | None:
        """Best by `metric_name` (ties ⇒ most recent); checkpoints without the metric are skipped with a warning.

        Falls back to the latest checkpoint when no metric is configured or none carries it.
        """
        ckpts = self.list_checkpoints()
        if not ckpts or self.cfg.metric_name is None:
            return self.get_latest_checkpoint_path()
        scored = {s: v for s, v in self._metrics(ckpts).items() if v is not None}
        missing = sorted(set(ckpts) - set(scored))
        if missing:
            warnings.warn(
                f"checkpoints at steps {missing} have no {self.cfg.metric_name!r}; ignored when picking the best",
                stacklevel=2,
            )
        if not scored:
            return self.get_latest_checkpoint_path()
        best = self._rank(list(scored), scored)[0]
        return ckpts[best]

    def load_training_info(self, path: str | Path) -> dict[str, Any]:
        """The training_info.json of a checkpoint directory (or the file itself)."""
        path = Path(path)
        file = path / TRAINING_INFO if path.is_dir() else path
        with open(file) as f:
            return json.load(f)

    def get_resume_paths(self, path: str | Path, component: str = "policy") -> tuple[Path, Path | None]:
        """(weights dir, optimizer dir or None) of `component` (policy / value) inside a checkpoint."""
        base = Path(path) / component
        weights, optimizer = base / "weights", base / "optimizer"
        if not optimizer.is_dir():
            warnings.warn(f"no optimizer state at {optimizer}; the optimizer starts fresh", stacklevel=2)
            return weights, None
        return weights, optimizer

    # ------------------------------------------------------------------ retention
    def remove_old_checkpoints(self) -> list[int]:
        """Delete checkpoints no rule protects; return the deleted steps.

        Kept: the latest step always; among "periodic" steps (`step % save_period == 0`) the `keep_top_k` best
        by metric (missing metric ranks worst) or, with no metric, the most recent. Non-periodic checkpoints
        (final or timeout saves) survive only while latest. `keep_top_k=None` keeps everything.
        """
        k = self.cfg.keep_top_k
        ckpts = self.list_checkpoints()
        if k is None or not ckpts:
            return []
        keep = {max(ckpts)}
        periodic = [s for s in ckpts if s % self.cfg.save_period == 0]
        if self.cfg.metric_name is None:
            keep.update(sorted(periodic, reverse=True)[:k])
        else:
            keep.update(self._rank(periodic, self._metrics({s: ckpts[s] for s in periodic}))[:k])
        removed = sorted(set(ckpts) - keep)
        for s in removed:
            try:
                _delete_dir(ckpts[s])
            except OSError as e:  # pruning must never fail a save that already succeeded
                warnings.warn(f"could not remove old checkpoint {ckpts[s]}: {e}", stacklevel=2)
        return removed

    def _metrics(self, ckpts: dict[int, Path]) -> dict[int, float | None]:
        """Metric value per step; None when absent, unreadable, or not a finite number."""
        out: dict[int, float | None] = {}
        for step, path in ckpts.items():
            try:
                value = self.load_training_info(path).get(self.cfg.metric_name)
            except (OSError, ValueError):
                value = None
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            out[step] = float(value) if ok else None
        return out

    def _rank(self, steps: list[int], metrics: dict[int, float | None]) -> list[int]:
        """Steps best-first; ties go to the more recent step, missing metrics last."""
        if self.cfg.higher_is_better:
            return sorted(steps, key=lambda s: (_or(metrics.get(s), -math.inf), s), reverse=True)
        return sorted(steps, key=lambda s: (_or(metrics.get(s), math.inf), -s))


# ---------------------------------------------------------------------------------------------------- helpers
def to_plain(value: Any) -> Any:
    """JSON/YAML-safe copy: tensors and numpy values become Python numbers or lists, tuples and paths plain."""
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # torch.Tensor, np.ndarray, numpy scalars
        return value.tolist()
    return value


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _delete_dir(path: Path) -> None:
    """Rename out of the `step_<N>` namespace first, so a crash mid-delete never leaves a gutted checkpoint."""
    trash = path.with_name(f"{_DELETING_PREFIX}{path.name}")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to disk before it is published by rename."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""Crash-safe checkpoint directories, retention of the best ones, the trainer's resumable counters, and state files
that cannot run code when they are read back.

Layout under `checkpoint_dir`:

    .owner.lock     flock'ed by the live run that writes here (released by the kernel when that run dies)
    tmp_step_<N>/   being written; never read on resume; stale ones are removed when the owning run starts
    step_<N>/       appears only through an atomic rename of a fully written, fsynced tmp_step_<N>
      manifest.json written last (after every other file is fsynced): each file's size and sha256. A step_<N>
                    without one, or whose files do not match it, is incomplete or damaged: resume skips it
    old_step_<N>/   transient, while an existing step_<N> is being replaced (restored by the next manager)
    deleting_*/     transient, a pruned checkpoint renamed away before its files are removed
    latest_checkpoint_status.json

A crash at any moment therefore leaves the previous complete `step_<M>` as the latest checkpoint.

Nothing read back from a checkpoint is unpickled: JSON (training_info, manifest), YAML (config, safe_load),
safetensors (weights, and the dataloader and RNG state through `save_state_file` / `load_state_file`); the
optimizer file is read with `torch.load(weights_only=True)`. Anything else, a pickle from an older relayrl or a
tampered file included, is refused with a `CheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import yaml

from relayrl.config import CheckpointingConfig
from relayrl.utils.dir_lock import LOCK_FILE, DirectoryInUseError, acquire_dir_lock
from relayrl.utils.state_file import CheckpointError

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^tmp_step_(\d+)$")
_OLD_RE = re.compile(r"^old_step_(\d+)$")
_DELETING_PREFIX = "deleting_"
TRAINING_INFO = "training_info.json"
RUN_CONFIG = "config.yaml"
STATUS_FILE = "latest_checkpoint_status.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "relayrl-checkpoint-manifest"
MANIFEST_VERSION = 1
OWNER_LOCK = LOCK_FILE
DATALOADER_STATE = "train_dataloader.safetensors"
DATA_PLANE_DIR = "data_plane"
"""Directory in step_N/ holding the data plane's store (`checkpointing.save_data_plane`)."""
RNG_STATE = "rng_state.safetensors"
#: What older relayrl versions wrote with torch.save (pickles): refused, never loaded.
LEGACY_PICKLES = ("train_dataloader.pt", "rng_state.pt")


class CheckpointDirInUseError(CheckpointError, DirectoryInUseError):
    """Another live run owns the checkpoint directory (`relayrl.utils.dir_lock`); the message names its pid."""


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
    schedule_steps: int | None = None  # max_num_steps the LR horizon was built from (kept on resume)
    train_rows: int | None = None  # the training set the run trains on: a resume on other data is refused
    train_data_sha256: str | None = None

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
    """Creates, finalizes, ranks and prunes `step_<N>` directories (synchronously, on the calling thread).

    The manager owns `checkpoint_dir` for its lifetime (`relayrl.utils.dir_lock`: an exclusive flock on
    `.owner.lock`; other managers of the same process share it): a second live run on the same directory is
    refused with a `CheckpointDirInUseError` (a `CheckpointError`) naming the holder's pid.
    Only the owner recovers interrupted swaps and removes stale `tmp_step_*` directories, at start. `log` gets
    one line per notable event (a skipped damaged checkpoint, a removed stale directory); default: stderr.
    """

    def __init__(
        self, cfg: CheckpointingConfig, checkpoint_dir: str | Path, log: Callable[[str], None] | None = None
    ) -> None:
        self.cfg = cfg
        self.checkpoint_dir = Path(checkpoint_dir)
        self.log = log or _print_stderr
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock = acquire_dir_lock(
                self.checkpoint_dir, "checkpoint directory", "set another checkpointing.checkpoint_dir"
            )
        except DirectoryInUseError as exc:
            raise CheckpointDirInUseError(str(exc), exc.directory, exc.holder) from None
        self._recover_interrupted_swaps()
        self._remove_stale_tmp()

    def close(self) -> None:
        """Give up ownership of the directory (also done when the manager is garbage-collected)."""
        self._lock.release()

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
        """Make `tmp_step_<N>` durable, seal it with its manifest, publish it as `step_<N>`, record it, prune."""
        tmp_path = Path(tmp_path)
        m = _TMP_RE.match(tmp_path.name)
        if m is None or not tmp_path.is_dir():
            raise ValueError(f"not a temporary checkpoint directory: {tmp_path}")
        step = int(m.group(1))
        write_manifest(tmp_path, step, periodic=step % self.cfg.save_period == 0, save_period=self.cfg.save_period)
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

    def _remove_stale_tmp(self) -> None:
        """Remove `tmp_step_*` directories a killed run left half-written (the owner alone gets here)."""
        for p in sorted(self.checkpoint_dir.iterdir()):
            if _TMP_RE.match(p.name) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                self.log(f"Removed {p}: a checkpoint save that never completed")

    # ------------------------------------------------------------------ reading
    def list_checkpoints(self) -> dict[int, Path]:
        """Every `step_<int>` directory by step, complete or not (see `complete_checkpoints`)."""
        out: dict[int, Path] = {}
        if not self.checkpoint_dir.is_dir():
            return out
        for p in self.checkpoint_dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m is not None and p.is_dir():
                out[int(m.group(1))] = p
        return dict(sorted(out.items()))

    def complete_checkpoints(self) -> dict[int, Path]:
        """Checkpoints whose manifest is readable and whose files all exist with the recorded sizes (no hashing;
        `get_latest_checkpoint_path` also checks contents)."""
        return {s: p for s, (p, _) in self._complete().items()}

    def _complete(self) -> dict[int, tuple[Path, dict[str, Any]]]:
        out: dict[int, tuple[Path, dict[str, Any]]] = {}
        for step, path in self.list_checkpoints().items():
            manifest, problem = _check_manifest(path, contents=False)
            if problem is None and manifest is not None:
                out[step] = (path, manifest)
        return out

    def get_latest_checkpoint_path(self) -> Path | None:
        """The newest complete checkpoint (manifest present, every file matching its size and sha256), or None.

        A newer incomplete or damaged one is skipped, with one line through `log` saying why. One written by an
        older relayrl (pickled dataloader/RNG state, no manifest) is refused with a `CheckpointError`: resuming
        from anything older instead would silently throw its training away.
        """
        for path in reversed(self.list_checkpoints().values()):
            if not (path / MANIFEST).exists():
                legacy = [path / name for name in LEGACY_PICKLES if (path / name).exists()]
                if legacy:
                    raise CheckpointError(
                        f"{legacy[0]}: pickled state from an older relayrl; refusing to load it (unpickling can "
                        f"run code); move {path} away to resume from an earlier checkpoint, or start a new run"
                    )
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            self.log(f"Skipping checkpoint {path}: {problem}")
        return None

    def get_best_checkpoint_path(self) -> Path | None:
        """Best complete checkpoint by `metric_name` (ties ⇒ most recent); checkpoints without the metric are
        skipped with a warning.

        Falls back to the newest complete checkpoint when no metric is configured or none carries it.
        """
        ckpts = self.complete_checkpoints()
        if not ckpts:
            return None
        if self.cfg.metric_name is None:
            return ckpts[max(ckpts)]
        scored = {s: v for s, v in self._metrics(ckpts).items() if v is not None}
        missing = sorted(set(ckpts) - set(scored))
        if missing:
            warnings.warn(
                f"checkpoints at steps {missing} have no {self.cfg.metric_name!r}; ignored when picking the best",
                stacklevel=2,
            )
        if not scored:
            return ckpts[max(ckpts)]
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
        """Delete complete checkpoints no rule protects; return the deleted steps.

        Kept: the newest complete checkpoint always; among "periodic" ones the `keep_top_k` best by metric
        (missing metric ranks worst) or, with no metric, the most recent. Whether a checkpoint is periodic
        (`step % save_period == 0`) was decided with the save_period of the run that wrote it and recorded in its
        manifest, so resuming with another save_period re-classifies nothing. Non-periodic checkpoints (final or
        timeout saves) survive only while newest. `keep_top_k=None` keeps everything. Incomplete or damaged
        directories are never deleted here (nothing can rank them; a re-save of their step replaces them).
        """
        k = self.cfg.keep_top_k
        complete = self._complete()
        if k is None or not complete:
            return []
        ckpts = {s: p for s, (p, _) in complete.items()}
        keep = {max(ckpts)}
        periodic = [s for s, (_, manifest) in complete.items() if manifest.get("periodic") is True]
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
        name = self.cfg.metric_name
        for step, path in ckpts.items():
            try:
                value = self.load_training_info(path).get(name) if name is not None else None
            except (OSError, ValueError):
                value = None
            finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            out[step] = float(value) if finite and value is not None else None
        return out

    def _rank(self, steps: list[int], metrics: Mapping[int, float | None]) -> list[int]:
        """Steps best-first; ties go to the more recent step, missing metrics last."""
        if self.cfg.higher_is_better:
            return sorted(steps, key=lambda s: (_or(metrics.get(s), -math.inf), s), reverse=True)
        return sorted(steps, key=lambda s: (_or(metrics.get(s), math.inf), -s))


# ---------------------------------------------------------------------------------------------------- manifest
def verify_checkpoint(path: str | Path, *, contents: bool = True) -> str | None:
    """None if `path` is a complete checkpoint, else why not (one line): no/unreadable manifest.json, a listed
    file missing, of another size, or (with `contents`) whose sha256 differs."""
    return _check_manifest(Path(path), contents=contents)[1]


def write_manifest(root: Path, step: int, *, periodic: bool, save_period: int) -> None:
    """fsync every file under `root` while hashing it, then write and fsync manifest.json, then the directories."""
    files: dict[str, dict[str, Any]] = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            file = Path(dirpath) / name
            rel = file.relative_to(root).as_posix()
            if rel == MANIFEST:
                continue
            with open(file, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
            files[rel] = {"size": size, "sha256": digest}
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "step": step,
        "periodic": periodic,
        "save_period": save_period,
        "written_at": time.time(),
        "files": dict(sorted(files.items())),
    }
    with open(root / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    for dirpath, _, _ in os.walk(root):
        _fsync_dir(Path(dirpath))


def _check_manifest(path: Path, *, contents: bool) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when `path` matches its manifest, else (None, the first problem found)."""
    file = path / MANIFEST
    if not file.is_file():
        return None, f"no {MANIFEST} (incomplete, or not written by this relayrl)"
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        return None, f"{MANIFEST} unreadable ({type(exc).__name__}: {exc})"
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or manifest.get("version") != MANIFEST_VERSION
        or not isinstance(entries, dict)
    ):
        return None, f"{MANIFEST} is not a relayrl checkpoint manifest (version {MANIFEST_VERSION})"
    root = path.resolve()
    for rel, entry in entries.items():
        target = (path / rel).resolve()
        if not isinstance(entry, dict) or root not in target.parents or rel == MANIFEST:
            return None, f"{MANIFEST} has an invalid entry {rel!r}"
        try:
            size = target.stat().st_size
        except OSError:
            return None, f"{rel} is missing"
        if size != entry.get("size"):
            return None, f"{rel} is {size} bytes, {MANIFEST} says {entry.get('size')} (truncated or damaged)"
        if contents:
            try:
                with open(target, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as exc:
                return None, f"{rel} unreadable ({exc})"
            if digest != entry.get("sha256"):
                return None, f"{rel} does not match its sha256 in {MANIFEST} (damaged or modified)"
    return manifest, None


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


def _print_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _delete_dir(path: Path) -> None:
    """Rename out of the `step_<N>` namespace first, so a crash mid-delete never leaves a gutted checkpoint."""
    trash = path.with_name(f"{_DELETING_PREFIX}{path.name}")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


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


# ---------------------------------------------------------------------------------------------------- data plane
class DataPlaneCheckpointing(Protocol):
    """The part of `relayrl.data_plane.DataPlaneClient` a trainer checkpoint uses (utils does not import it)."""

    def save_checkpoint(self, checkpoint_dir: str | Path, *, metadata: Mapping[str, Any] | None = None) -> None: ...

    def load_checkpoint(self, checkpoint_dir: str | Path) -> dict[str, Any]: ...


def data_plane_client_of(checkpointed: object) -> DataPlaneCheckpointing:
    """The data-plane client of what a trainer checkpoints: the policy, or the policy of a policy-and-critic pair
    (they share one store). ValueError when there is none: `save_data_plane` needs a data-plane trainer."""
    for owner in (checkpointed, getattr(checkpointed, "policy", None)):
        client = getattr(owner, "dp_client", None)
        if client is not None:
            return client  # type: ignore[no-any-return]
    raise ValueError("checkpointing.save_data_plane=true, but this trainer holds no data plane client")


def save_data_plane(client: DataPlaneCheckpointing, step_dir: Path, step: int) -> None:
    """Write the store into `step_dir/data_plane/` (inside the tmp step directory, so the step's own atomic rename
    and manifest cover it)."""
    client.save_checkpoint(step_dir / DATA_PLANE_DIR, metadata={"step": step})


def load_data_plane(client: DataPlaneCheckpointing, step_dir: Path) -> bool:
    """Restore the store saved in `step_dir/data_plane/`; False when that checkpoint has none (saved with
    `save_data_plane` off: the resume starts with the empty store it always had)."""
    if not (step_dir / DATA_PLANE_DIR).is_dir():
        return False
    client.load_checkpoint(step_dir / DATA_PLANE_DIR)
    return True

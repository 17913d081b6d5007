"""Reading a checkpoint that a live run may prune or re-save meanwhile, and refusing one that is damaged.

Commands that read checkpoints (`export`, `evaluate`, `replay`) never read a `step_N/` in place while a run may still
own the directory: its pruning renames and deletes older checkpoints, possibly the one picked, between two files of a
load. Instead every file the manifest lists is hard-linked into a private directory next to it (milliseconds,
no data copied; a published checkpoint's files are never modified, only unlinked), and the links are checked
against the manifest's sizes and sha256. From then on the reader holds an immutable, verified copy, whatever the run
does. A checkpoint that vanished while being linked is picked again (the newest intact one); a damaged one is
refused naming the file. Where links cannot be made (a read-only file system: then no run writes there either;
another file system) the checkpoint is verified and read in place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from relayrl.utils.checkpoint import MANIFEST, verify_checkpoint
from relayrl.utils.state_file import CheckpointError

#: Private directories of readers, inside the checkpoint directory (never a `step_N`, so never resumed or pruned).
READER_PREFIX = ".reading_"
_STEP = re.compile(r"^step_(\d+)$")
_NO_LINKS = (errno.EROFS, errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOSPC)


class CheckpointVanished(CheckpointError):
    """The checkpoint was pruned or replaced by its live run while it was being linked."""


def published_steps(checkpoint_dir: Path) -> list[int]:
    """Steps of the published `step_N` directories, newest first (never `tmp_step_*`, `old_step_*`, `deleting_*`)."""
    if not checkpoint_dir.is_dir():
        return []
    found = (_STEP.match(p.name) for p in checkpoint_dir.iterdir())
    return sorted((int(m.group(1)) for m in found if m is not None), reverse=True)


@contextlib.contextmanager
def read_checkpoint(path: Path) -> Iterator[Path]:
    """A verified, stable view of the published checkpoint `path` (its hard-linked copy, or `path` itself where no
    links can be made), removed on exit. `CheckpointError` naming the damaged file; `CheckpointVanished` when the
    live run pruned it meanwhile."""
    view = _link_copy(path)
    try:
        target = view or path
        problem = verify_checkpoint(target)
        if problem is not None:
            if not path.is_dir():
                raise CheckpointVanished(f"checkpoint {path} was removed by its run while being read")
            raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
        yield target
    finally:
        if view is not None:
            shutil.rmtree(view.parent, ignore_errors=True)


@contextlib.contextmanager
def read_latest_checkpoint(checkpoint_dir: Path, log: list[str] | None = None) -> Iterator[Path]:
    """`read_checkpoint` of the newest intact checkpoint in `checkpoint_dir`; a damaged newer one is skipped (one
    line each appended to `log`), one pruned while being linked is replaced by the then newest. CheckpointError
    when none is intact."""
    skipped: set[int] = set()
    for _ in range(20):  # each pass either succeeds, skips a damaged step, or saw the run publish a newer one
        candidates = [s for s in published_steps(checkpoint_dir) if s not in skipped]
        if not candidates:
            break
        step = candidates[0]
        try:
            stack = contextlib.ExitStack()
            view = stack.enter_context(read_checkpoint(checkpoint_dir / f"step_{step}"))
        except CheckpointVanished:
            continue
        except CheckpointError as exc:
            skipped.add(step)
            if log is not None:
                log.append(f"skipping {exc}")
            continue
        with stack:
            yield view
        return
    raise CheckpointError(f"{checkpoint_dir} holds no intact checkpoint; train until one is saved")


def remove_stale_readers(checkpoint_dir: Path) -> None:
    """Remove reader directories whose process is gone (a killed `export`); called by the owning run at start."""
    for p in checkpoint_dir.glob(f"{READER_PREFIX}*"):
        pid = p.name[len(READER_PREFIX) :].split("_", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _link_copy(path: Path) -> Path | None:
    """Hard links of `path`'s manifest and listed files in a private directory beside it; None where links cannot
    be made. CheckpointVanished when `path` or one of its files disappeared meanwhile."""
    if not (path / MANIFEST).is_file():
        if not path.is_dir():
            raise CheckpointVanished(f"checkpoint {path} was removed by its run while being read")
        return None  # verify_checkpoint names what is missing
    try:
        root = Path(tempfile.mkdtemp(prefix=f"{READER_PREFIX}{os.getpid()}_", dir=path.parent))
    except OSError as exc:
        if exc.errno in _NO_LINKS:
            return None
        raise
    view = root / path.name
    try:
        for dirpath, _, filenames in os.walk(path):
            rel = Path(dirpath).relative_to(path)
            (view / rel).mkdir(parents=True, exist_ok=True)
            for name in filenames:
                os.link(Path(dirpath) / name, view / rel / name)
        if not (view / MANIFEST).is_file():
            raise FileNotFoundError(path / MANIFEST)
    except FileNotFoundError:
        shutil.rmtree(root, ignore_errors=True)
        raise CheckpointVanished(f"checkpoint {path} was removed by its run while being read") from None
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)
        if exc.errno in _NO_LINKS:
            return None
        raise
    return view


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

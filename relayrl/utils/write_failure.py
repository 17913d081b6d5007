"""What made a write fail, in plain words, for the one line that reports it.

Python's own writes raise `OSError` with an errno, but torch's checkpoint writer (`torch.save`) reports a full disk
or a file size limit as its zip writer's internal state ("unexpected pos 194560 vs 194448"), and safetensors as its
own error: the errno is lost on the way. Where it is, it decides; where not, the state the failed write left
behind does: a file cut exactly at the process's file size limit (RLIMIT_FSIZE, `ulimit -f`), a file system with
(almost) no space left, or one mounted read-only. Otherwise the library's own words are kept.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NEARLY_FULL_BYTES", "WriteFailure", "describe_write_failure", "plain_reason"]

#: Less than this left on a file system after a failed write: the write failed for want of space. A write that
#: fails on a full disk has written what fit first, so what is left is below one block of the writer's.
NEARLY_FULL_BYTES = 1 << 20

_PLAIN = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "the directory vanished",
}


@dataclass(frozen=True)
class WriteFailure:
    """Where a write failed (the file, else the directory written into), why, and the bytes free there (None when
    the file system could not be asked)."""

    where: Path
    reason: str
    free_bytes: int | None

    def free_text(self) -> str:
        return "" if self.free_bytes is None else f"; {self.free_bytes / 2**20:.0f} MiB free there"


def describe_write_failure(exc: BaseException, target: Path) -> WriteFailure:
    """Why `exc` stopped a write into the directory `target` (a checkpoint's temporary directory), read from its errno
    or from what the write left in `target`; call it before `target` is cleaned up."""
    try:
        free: int | None = _free_bytes(target)
    except OSError:
        free = None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return plain_reason(exc, target, free, None if limit == resource.RLIM_INFINITY else limit)


def plain_reason(exc: BaseException, target: Path, free_bytes: int | None, fsize_limit: int | None) -> WriteFailure:
    """`describe_write_failure` given the bytes free at `target` and the file size limit (None: unlimited)."""
    filename = _filename(exc)
    code = _errno(exc)
    files = _files(target)
    cut = next((f for f, size, _ in files if fsize_limit is not None and size >= fsize_limit), None)
    newest = max(files, key=lambda f: f[2])[0] if files else None  # the file being written when it failed
    where = Path(filename) if filename else (cut or newest or target)
    limit_words = f"file size limit exceeded: the process may write files of at most {fsize_limit} bytes (ulimit -f)"
    if code == errno.EFBIG:
        reason = limit_words if fsize_limit is not None else "file too large for the file system"
    elif code in _PLAIN:
        reason = _PLAIN[code]
    elif code is not None:
        reason = os.strerror(code)
    elif cut is not None:
        reason = limit_words
    elif free_bytes is not None and free_bytes < NEARLY_FULL_BYTES:
        reason = "no space left on device"
    elif _read_only(target):
        reason = "read-only file system"
    else:  # nothing tells: the library's own words
        first = (str(exc).strip().splitlines() or [""])[0]
        reason = f"{type(exc).__name__}: {first}"
    return WriteFailure(where, reason, free_bytes)


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during, innermost last."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _errno(exc: BaseException) -> int | None:
    return next((e.errno for e in _chain(exc) if isinstance(e, OSError) and e.errno), None)


def _filename(exc: BaseException) -> str | None:
    return next((str(e.filename) for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)


def _files(target: Path) -> list[tuple[Path, int, int]]:
    """Every file the failed write left under `target`: (path, size, modification time in ns)."""
    found = []
    for path in target.rglob("*") if target.is_dir() else ():
        try:
            st = path.stat()
        except OSError:
            continue
        if path.is_file():
            found.append((path, st.st_size, st.st_mtime_ns))
    return found


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _free_bytes(target: Path) -> int:
    """Bytes free for ordinary users at `target` (df's Avail): at 0 when a disk filled up, root's reserve or not."""
    return shutil.disk_usage(_existing(target)).free


def _read_only(target: Path) -> bool:
    try:
        return bool(os.statvfs(_existing(target)).f_flag & os.ST_RDONLY)
    except OSError:
        return False

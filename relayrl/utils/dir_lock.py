"""One live process per directory: an exclusive advisory lock (flock) on `<directory>/.owner.lock`.

The run directory and the checkpoint directory (`checkpointing.checkpoint_dir`, which several runs could name)
are each owned by the run that writes there, for the whole run. The kernel drops a flock when its process dies,
however it dies (kill -9 included), so a lock left by a dead run is taken over silently: the file itself stays and
only records who holds it now (pid, host, start time) for the message a second run prints.

Within one process the lock is shared (reference-counted): a run's set-up and its checkpoint manager both hold
the directory they own, and sequential runs in one process (tests, `relayrl parity`) take it over in turn.
"""

from __future__ import annotations

import os
import socket
import time
import weakref
from pathlib import Path

try:  # POSIX; elsewhere every process counts as the owner
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".owner.lock"


class _Holder:
    """This process's descriptor of one lock file and how many `DirLock`s use it."""

    def __init__(self, key: str, fd: int) -> None:
        self.key, self.fd, self.count = key, fd, 1


_HELD: dict[str, _Holder] = {}  # realpath of a directory -> this process's hold on it


class DirectoryInUseError(ValueError):
    """Another live process owns the directory. One line naming the directory and the holder (pid, host, start
    time) and what to do; a ValueError, so the CLI reports it as bad input (exit 2)."""

    def __init__(self, message: str, directory: Path, holder: str) -> None:
        super().__init__(message)
        self.directory = directory
        self.holder = holder


class DirLock:
    """A held directory lock; `release()` (idempotent, also run when the object is garbage-collected) lets go."""

    def __init__(self, directory: Path, holder: _Holder) -> None:
        self.directory = directory
        self._finalizer = weakref.finalize(self, _release, holder)

    def release(self) -> None:
        self._finalizer()

    @property
    def held(self) -> bool:
        return self._finalizer.alive


def acquire_dir_lock(directory: str | Path, what: str, instead: str) -> DirLock:
    """Own `directory` (created if missing) for as long as the returned lock lives.

    Raises `DirectoryInUseError` at once, never waiting, when another live process owns it:
    "<what> <directory> is in use by pid N on HOST (started ...); wait for it or <instead>".
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(directory)
    held = _HELD.get(key)
    if held is not None and _same_file(held.fd, directory / LOCK_FILE):
        held.count += 1
        return DirLock(directory, held)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # O_CLOEXEC: children do not inherit it
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            who = os.pread(fd, 300, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DirectoryInUseError(
                f"{what} {directory} is in use by {who}; wait for it or {instead}", directory, who
            ) from exc
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} (started {started})\n".encode(), 0)
    holder = _HELD[key] = _Holder(key, fd)
    return DirLock(directory, holder)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` is still the file `fd` locks (a directory removed and made again holds a new one)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _release(holder: _Holder) -> None:
    holder.count -= 1
    if holder.count == 0:
        if _HELD.get(holder.key) is holder:
            del _HELD[holder.key]
        os.close(holder.fd)  # closing the last descriptor releases the flock


def lock_run_directories(
    run_dir: str | Path | None, checkpoint_dir: str | Path | None, *, create: bool = True
) -> list[DirLock]:
    """The run's ownership of its run directory and of a separately configured checkpoint directory.

    Taken first thing in set-up, before any model loads; `DirectoryInUseError` names the holder. With
    `create=False` (the CLI's first check, before it reads a resumed run's files) only existing ones are locked.
    """
    wanted = [
        (run_dir, "run directory", "use another --run-dir"),
        (checkpoint_dir, "checkpoint directory", "set another checkpointing.checkpoint_dir"),
    ]
    locks: list[DirLock] = []
    try:
        for directory, what, instead in wanted:
            if directory is not None and (create or Path(directory).is_dir()):
                locks.append(acquire_dir_lock(directory, what, instead))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks

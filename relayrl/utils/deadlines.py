"""Deadlines for blocking waits: a wait on another thread, process or host ends, with one line naming what hung.

A run that hangs is the most expensive silent failure: it shows nothing, holds its machines and never reaches its
next checkpoint. So every blocking call in relayrl has a deadline from the config, and running past it raises
`DeadlineError` with one line: what hung (the call, and the rank, worker, batch or partition), the deadline and the
config key that sets it. The CLI ends such a run with exit code 1 and the command that resumes it.

Four kinds of deadline (`cluster.*`, see `relayrl/config/infra.py`; docs/design.md has every call site):

* `start`: a worker starting (Ray ranks and actors, the async producer's generation process loading its model);
* `call`: a call on a worker (a Ray rank, a local rank thread, the async producer's generation process);
* `wait`: an in-process hand-off between threads (the async producer's batches, a thread's join, a lock held across
  another blocking call);
* `collective`: torch.distributed groups (gradients, the weight broadcast) and the refit's ZMQ sockets.

Some of that code runs where no config is at hand (a Ray rank's process group, a spawned generation process), so
`configure` publishes the deadlines in this process's environment, which Ray ranks (`RELAYRL_*` is forwarded) and
spawned children inherit; `deadline(kind)` reads them back, or the schema's defaults when nothing configured them.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from relayrl.config.infra import ClusterConfig

__all__ = ["Deadline", "DeadlineError", "configure", "deadline", "deadline_line", "held", "join", "recv", "wait_for"]

Kind = Literal["start", "call", "wait", "collective"]
_FIELDS: dict[str, str] = {
    "start": "start_timeout_s",
    "call": "call_timeout_s",
    "wait": "wait_timeout_s",
    "collective": "collective_timeout_s",
}
_ENV = {kind: f"RELAYRL_{kind.upper()}_TIMEOUT_S" for kind in _FIELDS}


class DeadlineError(TimeoutError):
    """A blocking call ran past its configured deadline; the message is one line naming what hung, the deadline and
    its config key. The run cannot continue (what it waited for is lost or wedged); it resumes from its last
    checkpoint."""


@dataclass(frozen=True)
class Deadline:
    """Seconds a wait may take, and the config key that set them (named in the error)."""

    seconds: float
    key: str

    def error(self, what: str) -> DeadlineError:
        return DeadlineError(f"{what} did not finish within {self.seconds:g}s ({self.key})")


def configure(cluster: ClusterConfig) -> None:
    """Make `cluster`'s deadlines this process's (and every rank's and child's it starts afterwards)."""
    for kind, name in _FIELDS.items():
        os.environ[_ENV[kind]] = repr(float(getattr(cluster, name)))


def deadline(kind: Kind) -> Deadline:
    """The configured deadline of one kind of wait (the schema's default until `configure` ran)."""
    name = _FIELDS[kind]
    raw = os.environ.get(_ENV[kind])
    seconds = float(raw) if raw else float(ClusterConfig.model_fields[name].default)
    return Deadline(seconds, f"cluster.{name}")


class _Joinable(Protocol):
    def join(self, timeout: float | None = None) -> None: ...
    def is_alive(self) -> bool: ...


def wait_for(cond: threading.Condition, predicate: Callable[[], Any], what: str, kind: Kind = "wait") -> None:
    """`cond.wait_for(predicate)` (the caller holds `cond`) that raises `DeadlineError` naming `what` past the
    deadline."""
    limit = deadline(kind)
    if not cond.wait_for(predicate, limit.seconds):
        raise limit.error(what)


def join(worker: _Joinable, what: str, kind: Kind = "wait") -> None:
    """Join a thread or process, or raise `DeadlineError` naming `what` (the thread is left running; a daemon one
    does not keep the process alive)."""
    limit = deadline(kind)
    worker.join(limit.seconds)
    if worker.is_alive():
        raise limit.error(what)


@contextlib.contextmanager
def held(lock: threading.Lock | threading.RLock, what: str, kind: Kind = "wait") -> Iterator[None]:
    """`with lock:` for a lock held across another blocking call: waiting for it is bounded too."""
    limit = deadline(kind)
    if not lock.acquire(timeout=limit.seconds):
        raise limit.error(what)
    try:
        yield
    finally:
        lock.release()


def recv(conn: multiprocessing.connection.Connection, what: str, kind: Kind = "call") -> Any:
    """`conn.recv()` once something arrived within the deadline (a closed pipe raises EOFError at once)."""
    limit = deadline(kind)
    if not conn.poll(limit.seconds):
        raise limit.error(what)
    return conn.recv()


_LINE = re.compile(r"within [0-9.e+-]+s \(")


def deadline_line(exc: BaseException) -> str:
    """The one line of a `DeadlineError` that names what hung; raised in a Ray actor, the error's text starts with
    Ray's own header and the remote traceback, so the line is looked for rather than taken first."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    found = [line for line in lines if _LINE.search(line)]
    line = found[-1] if found else (lines[0] if lines else type(exc).__name__)
    for prefix in ("relayrl.utils.deadlines.DeadlineError: ", "relayrl.distributed.errors.RemoteTimeoutError: "):
        line = line.removeprefix(prefix)
    return line

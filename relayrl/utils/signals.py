"""Graceful stop on SIGINT / SIGTERM: the first signal asks the loop to finish its step, checkpoint and exit; a
second one interrupts at once.

A run killed mid-step loses everything since its last periodic checkpoint; a run told to stop between steps loses
nothing, and its checkpoint resumes exactly. Only the main thread can own signal handlers, so elsewhere (a run
started from a worker thread) this is a no-op and the default behaviour stays.

The second signal raises KeyboardInterrupt in the main thread, wherever it waits (a reward function that never
returns, the async producer, a generation process). A process that owns its exit (the CLI, through
`set_forced_exit_deadline`) is also guaranteed to end: if the clean-up after that second signal takes longer than
the deadline (a wedged thread or child it waits for), it exits there with one line.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from types import FrameType, TracebackType

__all__ = ["GracefulStop", "TrainingInterrupted", "exit_code", "forced_stop", "set_forced_exit_deadline"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_FORCED = threading.Event()  # a second signal arrived: stop now, whatever is running
_EXIT_DEADLINE: list[tuple[float, str] | None] = [None]


def forced_stop() -> bool:
    """True once a second SIGINT / SIGTERM asked to stop at once: a KeyboardInterrupt then is the user's, not code's."""
    return _FORCED.is_set()


def set_forced_exit_deadline(seconds: float | None, note: str = "") -> None:
    """After a second signal, end the process at the latest `seconds` later, printing `note` at the end of its one
    line (None: never force; the default, for library use inside another program)."""
    _EXIT_DEADLINE[0] = None if seconds is None else (seconds, note)


def _arm_exit(signum: int) -> None:
    if _EXIT_DEADLINE[0] is None:
        return
    deadline, note = _EXIT_DEADLINE[0]

    def force() -> None:
        for child in multiprocessing.active_children():  # a generation process: never left orphaned
            child.kill()
        tail = f"; {note}" if note else ""
        print(f"relayrl: interrupted (clean-up did not finish within {deadline:g} s){tail}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(exit_code(signum))

    timer = threading.Timer(deadline, force)
    timer.daemon = True
    timer.start()


class TrainingInterrupted(Exception):
    """The run stopped on a signal after `step` (a checkpoint of it was written when `saved`)."""

    def __init__(self, signum: int, step: int, saved: bool) -> None:
        self.signum, self.step, self.saved = signum, step, saved
        name = signal.Signals(signum).name
        done = f"after step {step}, checkpoint saved" if saved else f"at step {step}, no new checkpoint"
        super().__init__(f"interrupted by {name} {done}")


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


class GracefulStop:
    """Context manager: while active, SIGINT/SIGTERM set `requested` instead of killing the process."""

    def __init__(self, on_request: str | None = None) -> None:
        self.requested: int | None = None
        self._notice = on_request
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        _FORCED.clear()
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:  # the second signal: stop now
            _FORCED.set()
            _arm_exit(signum)
            raise KeyboardInterrupt
        self.requested = signum
        if self._notice:
            print(self._notice, flush=True)

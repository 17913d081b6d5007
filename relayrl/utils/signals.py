"""Graceful stop on SIGINT / SIGTERM: the first signal asks the loop to finish its step, checkpoint and exit; a
second one interrupts at once.

A run killed mid-step loses everything since its last periodic checkpoint; a run told to stop between steps loses
nothing, and its checkpoint resumes exactly. Only the main thread can own signal handlers, so elsewhere (a run
started from a worker thread) this is a no-op and the default behaviour stays.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

__all__ = ["GracefulStop", "TrainingInterrupted", "exit_code"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
            raise KeyboardInterrupt
        self.requested = signum
        if self._notice:
            print(self._notice, flush=True)

"""Graceful stop on SIGINT / SIGTERM: the first signal asks the loop to finish its step, checkpoint and exit; a
second one interrupts at once.

A run killed mid-step loses everything since its last periodic checkpoint; a run told to stop between steps loses
nothing, and its checkpoint resumes exactly. Only the main thread can own signal handlers, so elsewhere (a run
started from a worker thread) this is a no-op and the default behaviour stays.

The second signal raises KeyboardInterrupt in the main thread, wherever it waits (a reward function that never
returns, the async producer, a generation process). A process that owns its exit (the CLI, through
`set_forced_exit_deadline`) is also guaranteed to end: if the clean-up after that second signal takes longer than
the deadline (a wedged thread or child it waits for), it exits there with one line.

`call_with_deadline`: a deadline for a call into user code (a reward function) that may never return.

On the main thread the call runs in place (user code that relies on the main thread keeps working: math-verify's
timeouts use SIGALRM there) and a timer thread sends SIGUSR2 to the main thread when the deadline passes; the handler
raises `DeadlineExceeded`, a BaseException so that the user's own `except Exception` cannot swallow it. This
interrupts Python code and blocking system calls (sleep, I/O, locks), not a C extension that never returns to the
interpreter: where the process owns its exit (`set_forced_exit_deadline`, the CLI), a call still running
`STUCK_GRACE_S` after its deadline ends the process with one line naming it and how to resume. Elsewhere (the async producer's thread, which cannot receive signals) the call runs in a daemon helper
thread that is abandoned on expiry; the caller carries on and the process can exit.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, TypeVar

__all__ = [
    "DeadlineExceeded",
    "GracefulStop",
    "TrainingInterrupted",
    "call_with_deadline",
    "exit_code",
    "forced_stop",
    "set_forced_exit_deadline",
]

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


# ---------------------------------------------------------------------------------------------------- deadlines
T = TypeVar("T")
_SIGNAL = signal.SIGUSR2
#: How long a call past its deadline may take to stop once interrupted before a process that owns its exit ends.
STUCK_GRACE_S = 10.0


class DeadlineExceeded(BaseException):
    """The call did not return within its deadline (raised in the caller, never inside other code)."""


def call_with_deadline(fn: Callable[[], T], timeout_s: float | None, what: str = "a call") -> T:
    """`fn()`, or `DeadlineExceeded` when it runs longer than `timeout_s` seconds (None: no deadline); `what` names
    the call in the line of a process that must end because the call cannot be interrupted."""
    if timeout_s is None:
        return fn()
    if threading.current_thread() is threading.main_thread():
        return _in_main_thread(fn, timeout_s, what)
    return _in_helper_thread(fn, timeout_s)


def _end_stuck(state: dict[str, bool], lock: threading.Lock, what: str, timeout_s: float) -> None:
    """The interrupted call is still running (native code that never returns to the interpreter): a process that
    owns its exit ends here with one line, its generation process with it; a library caller's process is left be."""
    with lock:
        if not state["active"] or _EXIT_DEADLINE[0] is None:
            return
        for child in multiprocessing.active_children():
            child.kill()
        note = _EXIT_DEADLINE[0][1]
        tail = f"; {note}" if note else ""
        print(
            f"relayrl: error: {what} did not return within its {timeout_s:g} s deadline and did not stop when "
            f"interrupted {STUCK_GRACE_S:g} s later (stuck outside Python, e.g. in a C extension){tail}",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(1)


def _in_main_thread(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    state = {"active": True, "expired": False}
    lock = threading.Lock()  # the timer sends its signal only while the call is still running
    main = threading.main_thread().ident
    assert main is not None

    def expire() -> None:
        with lock:
            if state["active"]:
                state["expired"] = True
                signal.pthread_kill(main, _SIGNAL)
                stuck = threading.Timer(STUCK_GRACE_S, _end_stuck, (state, lock, what, timeout_s))
                stuck.daemon = True
                stuck.start()

    def handler(signum: int, frame: Any) -> None:
        if state["active"] and state["expired"]:
            state["active"] = False
            raise DeadlineExceeded

    try:
        previous = signal.signal(_SIGNAL, handler)
    except ValueError:  # not the main interpreter: signals cannot be used
        return _in_helper_thread(fn, timeout_s)
    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        return fn()
    finally:
        with lock:
            state["active"] = False
        timer.cancel()
        # a signal sent just before is handled (and ignored) by our handler, which stays until the interpreter has
        # run its pending handlers: one no-op call lets it do so
        signal.pthread_sigmask(signal.SIG_BLOCK, [])
        signal.signal(_SIGNAL, previous)


def _in_helper_thread(fn: Callable[[], T], timeout_s: float) -> T:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="relayrl-deadline-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise DeadlineExceeded
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]

"""A deadline for a call into user code (a reward function) that may never return.

On the main thread the call runs in place (user code that relies on the main thread keeps working: math-verify's
timeouts use SIGALRM there) and a timer thread sends SIGUSR2 to the main thread when the deadline passes; the handler
raises `DeadlineExceeded`, a BaseException so that the user's own `except Exception` cannot swallow it. This
interrupts Python code and blocking system calls (sleep, I/O, locks), not a C extension that never returns to the
interpreter. Elsewhere (the async producer's thread, which cannot receive signals) the call runs in a daemon helper
thread that is abandoned on expiry; the caller carries on and the process can exit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_SIGNAL = signal.SIGUSR2


class DeadlineExceeded(BaseException):
    """The call did not return within its deadline (raised in the caller, never inside other code)."""


def call_with_deadline(fn: Callable[[], T], timeout_s: float | None) -> T:
    """`fn()`, or `DeadlineExceeded` when it runs longer than `timeout_s` seconds (None: no deadline)."""
    if timeout_s is None:
        return fn()
    if threading.current_thread() is threading.main_thread():
        return _in_main_thread(fn, timeout_s)
    return _in_helper_thread(fn, timeout_s)


def _in_main_thread(fn: Callable[[], T], timeout_s: float) -> T:
    state = {"active": True, "expired": False}
    lock = threading.Lock()  # the timer sends its signal only while the call is still running
    main = threading.main_thread().ident
    assert main is not None

    def expire() -> None:
        with lock:
            if state["active"]:
                state["expired"] = True
                signal.pthread_kill(main, _SIGNAL)

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

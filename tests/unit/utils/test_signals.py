"""Signals and deadlines: user code that may never return meets its deadline (in place on the main thread, in a
helper thread elsewhere), and a second Ctrl-C ends the process within its clean-up deadline."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from relayrl.utils.signals import DeadlineExceeded, call_with_deadline


def test_a_result_passes_through_and_the_signal_handler_is_restored():
    before = signal.getsignal(signal.SIGUSR2)
    assert call_with_deadline(lambda: 7, 5.0) == 7 and call_with_deadline(lambda: 8, None) == 8
    assert signal.getsignal(signal.SIGUSR2) == before


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_call_that_never_returns_meets_its_deadline(where):
    def stubborn() -> None:
        while True:
            try:
                time.sleep(60)
            except Exception:  # noqa: BLE001 - the deadline is no Exception: it cannot be swallowed so
                pass

    outcome: list[str] = []

    def attempt() -> None:
        start = time.monotonic()
        try:
            call_with_deadline(stubborn, 0.2)
        except DeadlineExceeded:
            outcome.append(f"{time.monotonic() - start:.1f}")

    if where == "main":
        attempt()
    else:
        worker = threading.Thread(target=attempt)
        worker.start()
        worker.join(10)
    assert outcome and float(outcome[0]) < 2.0


def test_errors_of_the_call_reach_the_caller():
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 / 0, 5.0)


_STUCK_CLEANUP = """
import os, signal, sys, time
from relayrl.utils.signals import GracefulStop, set_forced_exit_deadline
set_forced_exit_deadline(1.0, "resume with X")
with GracefulStop():
    print("ready", flush=True)
    try:
        time.sleep(60)
    finally:
        time.sleep(60)  # a clean-up that never ends (a wedged thread joined, a child waited for)
"""


def test_a_second_signal_ends_the_process_within_its_deadline():
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_CLEANUP], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - start < 5
    assert err.strip() == "relayrl: interrupted (clean-up did not finish within 1 s); resume with X"


_STUCK_IN_NATIVE_CODE = """
import signal, time
from relayrl.utils import signals

signals.STUCK_GRACE_S = 0.5
signals.set_forced_exit_deadline(5, "`relayrl train --run-dir R` resumes from the last checkpoint")


def stuck():
    # as a C extension that never returns to the interpreter: the deadline's signal is never handled
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    time.sleep(60)


signals.call_with_deadline(stuck, 0.3, "reward function 'stuck' (env.reward_timeout_s)")
"""


def test_a_call_stuck_outside_python_ends_a_process_that_owns_its_exit_with_one_line():
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", _STUCK_IN_NATIVE_CODE], capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 1 and time.monotonic() - start < 10, out.stderr
    assert out.stderr.strip() == (
        "relayrl: error: reward function 'stuck' (env.reward_timeout_s) did not return within its 0.3 s deadline and "
        "did not stop when interrupted 0.5 s later (stuck outside Python, e.g. in a C extension); `relayrl train "
        "--run-dir R` resumes from the last checkpoint"
    )

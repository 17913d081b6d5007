"""Wall-clock timing for the training loop, and the "save before the allocation runs out" check.

`Timer` collects every duration recorded under a label (labels may be nested paths such as
`policy_training/sharding_data`), so a step can report sums per phase while benchmarks can ask for the
median of many calls. `TimeoutChecker` answers once, at the end of a step, whether the next step might not
finish inside the `checkpointing.checkpoint_must_save_by` budget, so the loop can save and exit cleanly.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_REDUCTIONS: dict[str, Callable[[list[float]], float]] = {
    "mean": statistics.fmean,
    "median": statistics.median,
    "min": min,
    "max": max,
    # Population std (numpy's default): one sample gives 0.0 rather than an error.
    "std": statistics.pstdev,
    "sum": lambda xs: float(sum(xs)),
    "count": lambda xs: float(len(xs)),
}


class Timer:
    """Named stopwatches whose measurements accumulate until `reset`.

    All methods take an internal re-entrant lock, so worker threads (e.g. a background checkpoint writer) may
    record into the same timer as the main loop.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._running: dict[str, float] = {}
        self._timings: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ measuring
    def start(self, label: str) -> None:
        """Start the stopwatch `label`; starting one that is already running is a bug in the caller."""
        with self._lock:
            if label in self._running:
                raise ValueError(f"timer {label!r} is already running")
            self._running[label] = time.perf_counter()

    def stop(self, label: str) -> float:
        """Stop `label`, record and return the elapsed seconds."""
        now = time.perf_counter()
        with self._lock:
            if label not in self._running:
                raise ValueError(f"timer {label!r} is not running")
            elapsed = now - self._running.pop(label)
            self._timings.setdefault(label, []).append(elapsed)
            return elapsed

    @contextmanager
    def time(self, label: str) -> Iterator[None]:
        """Time the body of a `with` block (recorded even when the body raises)."""
        self.start(label)
        try:
            yield
        finally:
            self.stop(label)

    def record(self, label: str, seconds: float) -> None:
        """Add a duration measured elsewhere (e.g. returned by a remote worker)."""
        with self._lock:
            self._timings.setdefault(label, []).append(float(seconds))

    def is_running(self, label: str) -> bool:
        with self._lock:
            return label in self._running

    # ------------------------------------------------------------------ reading
    @property
    def labels(self) -> list[str]:
        """Labels with at least one measurement, in first-recorded order."""
        with self._lock:
            return list(self._timings)

    def get_elapsed(self, label: str) -> list[float]:
        """Every recorded duration of `label` (a copy); KeyError if it never finished."""
        with self._lock:
            if label not in self._timings:
                raise KeyError(f"no timings recorded for {label!r}")
            return list(self._timings[label])

    def get_latest_elapsed(self, label: str) -> float:
        """The most recent duration of `label`."""
        return self.get_elapsed(label)[-1]

    def reduce(self, label: str, op: str = "mean") -> float:
        """One of mean/median/min/max/std/sum/count over `label`'s durations."""
        if op not in _REDUCTIONS:
            raise ValueError(f"unknown reduction {op!r}; expected one of {', '.join(_REDUCTIONS)}")
        return float(_REDUCTIONS[op](self.get_elapsed(label)))

    def get_timing_metrics(self, reduction_op: str | dict[str, str] = "sum") -> dict[str, float | list[float]]:
        """Timings of every label, ready to log.

        A string op applies to all labels (values are floats). A dict maps label -> op; labels missing from it
        come back as the raw list of durations.
        """
        if isinstance(reduction_op, str) and reduction_op not in _REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction_op!r}; expected one of {', '.join(_REDUCTIONS)}")
        out: dict[str, float | list[float]] = {}
        for label in self.labels:
            op = reduction_op if isinstance(reduction_op, str) else reduction_op.get(label)
            out[label] = self.get_elapsed(label) if op is None else self.reduce(label, op)
        return out

    def reset(self, label: str | None = None) -> None:
        """Forget the measurements (and any running stopwatch) of `label`, or of everything."""
        with self._lock:
            if label is None:
                self._timings.clear()
                self._running.clear()
            else:
                self._timings.pop(label, None)
                self._running.pop(label, None)


def convert_to_seconds(duration: str) -> int:
    """Parse a `DD:HH:MM:SS` budget (the format of `checkpointing.checkpoint_must_save_by`) into seconds."""
    parts = duration.split(":") if isinstance(duration, str) else []
    if len(parts) != 4 or not all(p.isascii() and p.isdecimal() for p in parts):
        raise ValueError(f"invalid duration {duration!r}: expected 'DD:HH:MM:SS' with non-negative integers")
    days, hours, minutes, seconds = (int(p) for p in parts)
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


class TimeoutChecker:
    """Decides when to save and stop so the run ends before a wall-clock budget expires.

    The clock starts at construction (so setup counts against the budget). With `fit_last_save_time`, the
    check fires as soon as another iteration of average length would overrun the budget; otherwise only once
    the budget is actually spent. It fires at most once: the caller saves, then exits.
    """

    def __init__(self, timeout: str | None, fit_last_save_time: bool = True) -> None:
        self.timeout_s: int | None = None if timeout is None else convert_to_seconds(timeout)
        self.fit_last_save_time = fit_last_save_time
        self.start_time = time.monotonic()
        self.iteration_times: list[float] = []
        self._iteration_start: float | None = None
        self._fired = False

    def start_iterations(self) -> None:
        """Call just before the first step so the first iteration's length excludes setup."""
        self._iteration_start = time.monotonic()

    def mark_iteration(self) -> None:
        """Call at the end of each step: records its length and starts timing the next."""
        now = time.monotonic()
        if self._iteration_start is not None:
            self.iteration_times.append(now - self._iteration_start)
        self._iteration_start = now

    def check_save(self) -> bool:
        """True exactly once, when the budget is (about to be) exhausted; always False without a budget."""
        if self.timeout_s is None or self._fired:
            return False
        elapsed = time.monotonic() - self.start_time
        needed = elapsed
        if self.fit_last_save_time and self.iteration_times:
            needed += statistics.fmean(self.iteration_times)
        if needed >= self.timeout_s:
            self._fired = True
            return True
        return False

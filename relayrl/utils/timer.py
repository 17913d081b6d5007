"""Wall-clock timing for the training loop, and the "save before the allocation runs out" check.

`Timer` collects every duration recorded under a label (labels may be nested paths such as
`policy_training/sharding_data`), so a step can report sums per phase while benchmarks can ask for the
median of many calls. `STEP_PHASES` names a training step's top-level phases: disjoint, and together the whole
`total_step_time`, so a breakdown adds up (`phase_remainder` is what they leave uncovered; every other label is a
sub-phase timed inside one of them). `TimeoutChecker` answers once, at the end of a step, whether the next step
might not finish inside the `checkpointing.checkpoint_must_save_by` budget, so the loop can save and exit cleanly.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
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


#: A training step's top-level phases, in the order a step runs them (the stacked chart's order). They are disjoint
#: and cover `TOTAL`: from the step's start to the end of its checkpoint. Every other label is a sub-phase, timed
#: inside one of these (`policy_training/shard_meta`, `get_logprobs/submit_futures`, ...), and is not summed.
STEP_PHASES: tuple[str, ...] = (
    "data_processing",  # prompts repeated per group, overlong filtering, the legacy trainers' train batch
    "refit",  # the trainer's weights to the generation engine (`prepare_for_generation`); async: the snapshot
    "generation",  # the engine's rollout, less the environment's and the store's share measured inside it
    "environment",  # `env.step` of every turn (rewards, tool calls), episode start and end
    "waiting",  # async: the trainer waiting for the producer's batch
    "reward_calculation",  # reward scaling/shaping and the per-group baseline on the driver
    "dynamic_sampling",
    "value_inference",  # PPO's critic values
    "prev_logprobs",  # the previous policy's log-probs and the generation-vs-training log-prob error
    "reference",  # the reference policy's log-probs
    "advantage_calculation",
    "value_training",
    "policy_training",
    "recompute_kv_scales",  # FP8 KV cache calibration
    "flight_recorder",
    "data_plane",  # the driver's own store calls: partition set-up, claims, counters, clearing the step's keys
    "logging",  # the step's metrics computed and written (metrics.jsonl, TensorBoard, ...), its sample rows
    "validation",
    "checkpointing",
)
TOTAL = "total_step_time"
#: `TOTAL` less the sum of `STEP_PHASES`, logged with them: the statements after the step's last phase (the phases
#: being contiguous, nothing else), negative if two phases overlapped. Each trainer's test holds it within 2%.
UNACCOUNTED = "unaccounted"


def phase_remainder(timings: Mapping[str, float | list[float]]) -> float:
    """`TOTAL` less its phases in one step's summed timings (negative would mean two phases overlap)."""
    covered = sum(float(v) for k, v in timings.items() if k in STEP_PHASES and not isinstance(v, list))
    return float(timings[TOTAL]) - covered  # type: ignore[arg-type]


class Timer:
    """Named stopwatches whose measurements accumulate until `reset`.

    All methods take an internal re-entrant lock, so worker threads (e.g. a background checkpoint writer) may
    record into the same timer as the main loop.

    While `TOTAL` runs, the top-level phases (`STEP_PHASES`) are contiguous: each one starts where the previous one
    ended (the step's first where the step started), so the few statements between two phases (their glue) count in
    the phase they lead into, and a step's phases add up to its total whatever the machine's load. Another label, or
    a top-level phase started inside one (a bug a breakdown shows as a negative `unaccounted`), times just its body.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._running: dict[str, float] = {}
        self._timings: dict[str, list[float]] = {}
        self._phase_end: float | None = None  # where the step's next top-level phase starts (TOTAL running)

    # ------------------------------------------------------------------ measuring
    def start(self, label: str) -> None:
        """Start the stopwatch `label`; starting one that is already running is a bug in the caller."""
        now = time.perf_counter()
        with self._lock:
            if label in self._running:
                raise ValueError(f"timer {label!r} is already running")
            if label == TOTAL:
                self._phase_end = now
            elif self._leads_phase(label):
                assert self._phase_end is not None
                now = self._phase_end  # its lead-in: the statements since the previous phase ended
            self._running[label] = now

    def stop(self, label: str) -> float:
        """Stop `label`, record and return the elapsed seconds."""
        now = time.perf_counter()
        with self._lock:
            if label not in self._running:
                raise ValueError(f"timer {label!r} is not running")
            elapsed = now - self._running.pop(label)
            self._timings.setdefault(label, []).append(elapsed)
            if label == TOTAL:
                self._phase_end = None
            elif self._leads_phase(label):
                self._phase_end = now
            return elapsed

    def _leads_phase(self, label: str) -> bool:
        """`label` is a top-level phase of a running step, and no other top-level phase runs (lock held)."""
        return (
            label in STEP_PHASES
            and self._phase_end is not None
            and not any(other in STEP_PHASES for other in self._running if other != label)
        )

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

    def split_off(self, label: str, part: str, seconds: float) -> None:
        """Move `seconds` of `label`'s latest duration to `part`: time measured elsewhere inside it (the
        environment's share of a rollout in the actor) becomes a phase of its own, and the two stay disjoint."""
        with self._lock:
            latest = self._timings[label]
            moved = min(max(float(seconds), 0.0), latest[-1])
            latest[-1] -= moved
            self._timings.setdefault(part, []).append(moved)

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

    def elapsed_so_far(self, label: str) -> float:
        """The sum of `label`'s durations, including the one still running (0.0 when it never ran)."""
        now = time.perf_counter()
        with self._lock:
            running = now - self._running[label] if label in self._running else 0.0
            return float(sum(self._timings.get(label, ()))) + running

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
                self._phase_end = None
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

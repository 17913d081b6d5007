from __future__ import annotations

import statistics
import threading
import time

import pytest

from relayrl.utils import timer as timer_mod
from relayrl.utils.timer import (
    STEP_PHASES,
    TOTAL,
    TimeoutChecker,
    Timer,
    convert_to_seconds,
    phase_remainder,
)


class FakeClock:
    """Stands in for time.perf_counter / time.monotonic so durations are exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(timer_mod.time, "perf_counter", c)
    monkeypatch.setattr(timer_mod.time, "monotonic", c)
    return c


def test_start_stop_records_elapsed(clock: FakeClock) -> None:
    t = Timer()
    t.start("gen")
    clock.now += 2.5
    assert t.stop("gen") == pytest.approx(2.5)
    t.start("gen")
    clock.now += 0.5
    t.stop("gen")
    assert t.get_elapsed("gen") == pytest.approx([2.5, 0.5])
    assert t.get_latest_elapsed("gen") == pytest.approx(0.5)


def test_start_twice_and_stop_unstarted_raise() -> None:
    t = Timer()
    t.start("a")
    with pytest.raises(ValueError, match="already running"):
        t.start("a")
    with pytest.raises(ValueError, match="not running"):
        t.stop("b")


def test_context_manager_records_even_on_error(clock: FakeClock) -> None:
    t = Timer()
    with pytest.raises(RuntimeError):
        with t.time("step"):
            clock.now += 3.0
            raise RuntimeError("boom")
    assert t.get_elapsed("step") == pytest.approx([3.0])
    assert not t.is_running("step")


def test_nested_labels_are_independent(clock: FakeClock) -> None:
    t = Timer()
    with t.time("policy_training"):
        clock.now += 1.0
        with t.time("policy_training/sharding_data"):
            clock.now += 0.25
        clock.now += 1.0
    metrics = t.get_timing_metrics("sum")
    assert metrics == pytest.approx({"policy_training": 2.25, "policy_training/sharding_data": 0.25})


def test_split_off_moves_time_measured_inside_a_phase_to_its_own(clock: FakeClock) -> None:
    t = Timer()
    with t.time("generation"):
        clock.now += 2.0
    with t.time("generation"):
        clock.now += 1.0
    t.split_off("generation", "environment", 0.25)  # the latest duration only
    t.split_off("generation", "data_plane", 5.0)  # never more than the duration holds
    assert t.get_elapsed("generation") == pytest.approx([2.0, 0.0])
    assert t.get_timing_metrics("sum") == pytest.approx({"generation": 2.0, "environment": 0.25, "data_plane": 0.75})


def test_a_steps_phases_are_contiguous_and_add_up(clock: FakeClock) -> None:
    t = Timer()
    t.start(TOTAL)
    clock.now += 0.125  # before the first phase: its lead-in
    with t.time("policy_training"):
        clock.now += 1.0
        with t.time("policy_training/shard_meta"):  # a sub-phase: inside its phase, not summed again
            clock.now += 0.5
    clock.now += 0.25  # glue between two phases: the next one's
    assert t.elapsed_so_far(TOTAL) == pytest.approx(1.875)
    with t.time("checkpointing"):
        clock.now += 2.0
    clock.now += 0.0625  # after the last phase: in none
    t.stop(TOTAL)
    timings = t.get_timing_metrics("sum")
    assert timings == pytest.approx(
        {"policy_training": 1.625, "policy_training/shard_meta": 0.5, "checkpointing": 2.25, TOTAL: 3.9375}
    )
    assert phase_remainder(timings) == pytest.approx(0.0625)
    # outside a step, and for a top-level phase started inside another, only the body counts (an overlap shows)
    clock.now += 1.0
    with t.time("generation"):
        clock.now += 0.5
    assert t.get_elapsed("generation") == pytest.approx([0.5])
    t.reset()
    t.start(TOTAL)
    with t.time("validation"):
        clock.now += 1.0
        with t.time("recompute_kv_scales"):
            clock.now += 0.25
    t.stop(TOTAL)
    assert phase_remainder(t.get_timing_metrics("sum")) == pytest.approx(-0.25)
    assert "policy_training" in STEP_PHASES and len(set(STEP_PHASES)) == len(STEP_PHASES)
    assert all("/" not in p for p in STEP_PHASES)


def test_reduce_ops() -> None:
    t = Timer()
    values = [1.0, 4.0, 2.0, 3.0, 10.0]
    for v in values:
        t.record("x", v)
    assert t.reduce("x", "mean") == pytest.approx(4.0)
    assert t.reduce("x", "median") == pytest.approx(3.0)
    assert t.reduce("x", "min") == 1.0
    assert t.reduce("x", "max") == 10.0
    assert t.reduce("x", "std") == pytest.approx(statistics.pstdev(values))
    assert t.reduce("x", "sum") == pytest.approx(20.0)
    assert t.reduce("x", "count") == 5.0
    assert t.reduce("x") == pytest.approx(4.0)  # default op is mean


def test_reduce_errors() -> None:
    t = Timer()
    t.record("x", 1.0)
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        t.reduce("x", "avg")
    with pytest.raises(KeyError, match="missing"):
        t.reduce("missing", "sum")
    with pytest.raises(ValueError, match="unknown reduction"):
        t.get_timing_metrics("p99")


def test_get_timing_metrics_per_label_ops_and_raw_lists() -> None:
    t = Timer()
    t.record("a", 1.0)
    t.record("a", 3.0)
    t.record("b", 5.0)
    t.record("b", 7.0)
    metrics = t.get_timing_metrics({"a": "max"})
    assert metrics == {"a": 3.0, "b": [5.0, 7.0]}


def test_reset_one_label_or_all() -> None:
    t = Timer()
    t.record("a", 1.0)
    t.record("b", 2.0)
    t.start("c")
    t.reset("a")
    assert t.labels == ["b"]
    assert t.is_running("c")
    t.reset()
    assert t.labels == [] and not t.is_running("c")
    assert t.get_timing_metrics() == {}


def test_record_from_threads_is_safe() -> None:
    t = Timer()

    def work() -> None:
        for _ in range(500):
            t.record("w", 0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.reduce("w", "count") == 2000


def test_real_clock_measures_sleep() -> None:
    t = Timer()
    with t.time("sleep"):
        time.sleep(0.02)
    assert 0.015 < t.get_latest_elapsed("sleep") < 1.0


# ---------------------------------------------------------------------------------------------------- timeout
@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:00:00:00", 0), ("00:00:01:30", 90), ("00:04:00:00", 14400), ("01:00:00:01", 86401), ("2:3:4:5", 183845)],
)
def test_convert_to_seconds(text: str, seconds: int) -> None:
    assert convert_to_seconds(text) == seconds


@pytest.mark.parametrize("bad", ["04:00:00", "1:2:3:4:5", "aa:00:00:00", "00:-1:00:00", "", "00:00:00:1.5"])
def test_convert_to_seconds_rejects_bad_format(bad: str) -> None:
    with pytest.raises(ValueError, match="DD:HH:MM:SS") as err:
        convert_to_seconds(bad)
    assert repr(bad) in str(err.value)


def test_timeout_none_never_fires(clock: FakeClock) -> None:
    tc = TimeoutChecker(None)
    clock.now += 10**9
    assert tc.check_save() is False


def checks_after_iterations(tc: TimeoutChecker, clock: FakeClock, n: int = 6, seconds: float = 20.0) -> list[bool]:
    """`check_save()` after each of `n` iterations of `seconds` each."""
    results = []
    for _ in range(n):
        clock.now += seconds
        tc.mark_iteration()
        results.append(tc.check_save())
    return results


def test_timeout_fits_next_iteration_and_fires_once(clock: FakeClock) -> None:
    tc = TimeoutChecker("00:00:01:40")  # 100 s
    clock.now += 10.0  # setup counts against the budget
    tc.start_iterations()
    results = checks_after_iterations(tc, clock)
    # elapsed after k iterations = 10 + 20k; fires when elapsed + mean(20) >= 100, i.e. k = 4 (90 + 20 >= 100)
    assert results == [False, False, False, True, False, False]
    assert tc.iteration_times == pytest.approx([20.0] * 6)


def test_timeout_without_fitting_waits_for_budget(clock: FakeClock) -> None:
    tc = TimeoutChecker("00:00:01:40", fit_last_save_time=False)
    tc.start_iterations()
    assert checks_after_iterations(tc, clock) == [False, False, False, False, True, False]


def test_timeout_bad_format_raises() -> None:
    with pytest.raises(ValueError, match="'1h'"):
        TimeoutChecker("1h")

"""`relayrl diff` helpers: which metrics are compared and where two metric logs first differ."""

from __future__ import annotations

import math

from relayrl.cli.diff import first_metric_divergence, is_timed, same


def test_timed_metrics_are_not_compared():
    for name in ("timing/train/total_step_time", "performance/samples_per_sec", "train/valid_tokens_per_sec",
                 "data_plane/get/ms_total", "refit/ms_per_mb"):  # fmt: skip
        assert is_timed(name), name
    for name in ("train/loss", "train/driver_bytes", "validation/accuracy", "data_plane/put/bytes"):
        assert not is_timed(name), name


def test_first_divergence_prefers_training_metrics_at_the_first_step():
    a = {0: {"validation/accuracy": 0.5}, 1: {"data_plane/put/bytes": 10.0, "train/loss": 1.0, "train/reward": 0.2}}
    b = {0: {"validation/accuracy": 0.5}, 1: {"data_plane/put/bytes": 11.0, "train/loss": 1.5, "train/reward": 0.2}}
    assert first_metric_divergence(a, b) == (1, ["train/loss", "data_plane/put/bytes"])
    assert first_metric_divergence(a, a) is None


def test_a_metric_only_one_run_logged_is_a_divergence():
    assert first_metric_divergence({1: {"train/x": 1.0}}, {1: {"train/x": 1.0, "train/y": 2.0}}) == (1, ["train/y"])


def test_nan_equals_nan():
    assert same(math.nan, math.nan) and not same(1.0, math.nan)

"""`relayrl diff` helpers: which metrics are compared and where two metric logs first differ."""

from __future__ import annotations

import math

from relayrl.cli.diff import first_metric_divergence, is_timed, same


def test_timed_metrics_are_not_compared():
    for name in ("timing/train/total_step_time", "performance/samples_per_sec", "train/valid_tokens_per_sec",
                 "data_plane/get/ms_total", "refit/ms_per_mb", "data_plane/all/get/ms_p90",
                 "data_plane/share_of_step", "data_plane/all/checksum/cpu_ms", "train/env/tool_latency_s",
                 "validation/env/search/tool_latency_s"):  # fmt: skip
        assert is_timed(name), name
    for name in (
        "train/loss",
        "train/driver_bytes",
        "validation/accuracy",
        "data_plane/put/bytes",
        "train/env/tool_calls",
    ):
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


def test_transport_counters_are_compared_only_with_all(tmp_path, capsys):
    """Two async runs differ in occupancy and byte counters by when the producer ran: not a divergence by default."""
    import json

    from relayrl.cli.diff import is_transport
    from relayrl.cli.main import main

    for name in ("data_plane/held_bytes/train_b2", "data_plane/all/get_bytes", "train/driver_bytes",
                 "train/driver_meta_bytes", "train/store_bytes_written", "train/driver_fraction_of_store_bytes"):  # fmt: skip
        assert is_transport(name), name
    for name in ("train/loss", "train/reward", "validation/accuracy", "async/trajectory_age_mean"):
        assert not is_transport(name), name
    for run, held in (("a", 59400.0), ("b", 0.0)):
        (tmp_path / run).mkdir()
        rows = [{"step": 1, "train/loss": 0.5, "data_plane/held_bytes_total": held, "train/driver_meta_bytes": held}]
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["diff", "--all", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "data_plane/held_bytes_total" in capsys.readouterr().out

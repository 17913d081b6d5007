"""Sequence-level train/generation log-prob error metrics and threshold masking."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.logprob_error import compute_seq_logprob_error_metrics

T = torch.tensor


def _rows(errors_per_row: list[list[float]], seq_len: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_mask (position 0 is never a loss position), prev = 0 and gen = prev + error at the listed positions."""
    b = len(errors_per_row)
    token_mask = torch.ones(b, seq_len)
    prev = torch.zeros(b, seq_len)
    gen = torch.zeros(b, seq_len)
    for i, errs in enumerate(errors_per_row):
        for j, e in enumerate(errs):
            gen[i, 1 + j] = -e
    return token_mask, prev, gen


def _err(n_tokens: int, errs: list[float]) -> float:
    return (n_tokens - len(errs) + sum(math.exp(e) for e in errs)) / n_tokens


def test_metrics_only_without_threshold() -> None:
    tm, prev, gen = _rows([[0.1] * 4, [0.5] * 4])
    sm = torch.ones(2)
    out_mask, metrics = compute_seq_logprob_error_metrics(tm, sm, prev, gen, T([1.0, 0.0]), None)
    assert out_mask is sm
    assert set(metrics) == {"max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error"}
    assert metrics["min_seq_mult_prob_error"] == pytest.approx(1.0467, abs=1e-4)
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(1.2883, abs=1e-4)
    assert metrics["mean_seq_mult_prob_error"] == pytest.approx((1.0467 + 1.2883) / 2, abs=1e-4)


def test_threshold_masks_high_error_rows() -> None:
    tm, prev, gen = _rows([[0.1] * 4, [0.1] * 4, [0.5] * 4, [1.0] * 4])
    out_mask, metrics = compute_seq_logprob_error_metrics(tm, torch.ones(4), prev, gen, T([1.0, 0.0, 1.0, 0.0]), 1.2)
    assert out_mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert metrics["num_masked_seqs_by_logprob_error"] == 2
    assert metrics["masked_correct_pct"] == pytest.approx(0.5)
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(1.7637, abs=1e-4)
    assert metrics["max_seq_mult_prob_error_after_mask"] == pytest.approx(1.0467, abs=1e-4)
    assert metrics["min_seq_mult_prob_error_after_mask"] == pytest.approx(1.0467, abs=1e-4)


def test_all_below_threshold_none_masked() -> None:
    tm, prev, gen = _rows([[0.1] * 4, [0.5] * 4, [1.0] * 4])
    out_mask, metrics = compute_seq_logprob_error_metrics(tm, torch.ones(3), prev, gen, T([1.0, 1.0, 0.0]), 2.0)
    assert out_mask.tolist() == [1.0, 1.0, 1.0]
    assert metrics["num_masked_seqs_by_logprob_error"] == 0
    assert metrics["masked_correct_pct"] == 0.0
    assert metrics["max_seq_mult_prob_error_after_mask"] == pytest.approx(1.7637, abs=1e-4)


def test_all_above_threshold_all_masked() -> None:
    tm, prev, gen = _rows([[0.1] * 4, [0.5] * 4, [1.0] * 4])
    out_mask, metrics = compute_seq_logprob_error_metrics(tm, torch.ones(3), prev, gen, T([1.0, 1.0, 0.0]), 1.0)
    assert out_mask.tolist() == [0.0, 0.0, 0.0]
    assert metrics["num_masked_seqs_by_logprob_error"] == 3
    assert metrics["masked_correct_pct"] == pytest.approx(2 / 3)
    for k in ("max", "mean", "min"):
        assert metrics[f"{k}_seq_mult_prob_error_after_mask"] == 0.0


def test_pre_masked_row_stays_masked_and_is_not_counted() -> None:
    tm, prev, gen = _rows([[0.1] * 4, [1.0] * 4, [2.0] * 4])
    sm = T([1.0, 1.0, 0.0])  # row 2 has the largest error but is already out
    out_mask, metrics = compute_seq_logprob_error_metrics(tm, sm, prev, gen, T([1.0, 1.0, 1.0]), 1.5)
    assert out_mask.tolist() == [1.0, 0.0, 0.0]
    assert metrics["num_masked_seqs_by_logprob_error"] == 1
    assert metrics["masked_correct_pct"] == 1.0
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(1.7637, abs=1e-4)  # row 2 excluded from stats


def test_token_mask_reduces_row_error() -> None:
    # both rows: 7 loss positions, error 1.0 on the first 5; row 0 masks 3 of the erroneous tokens
    tm, prev, gen = _rows([[1.0] * 5, [1.0] * 5], seq_len=8)
    tm[0, 1:4] = 0.0
    out_mask, metrics = compute_seq_logprob_error_metrics(tm, torch.ones(2), prev, gen, T([1.0, 0.0]), 2.0)
    assert _err(4, [1.0, 1.0]) == pytest.approx(1.859, abs=1e-3)
    assert _err(7, [1.0] * 5) == pytest.approx(2.227, abs=1e-3)
    assert metrics["min_seq_mult_prob_error"] == pytest.approx(_err(4, [1.0, 1.0]), abs=1e-5)
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(_err(7, [1.0] * 5), abs=1e-5)
    assert out_mask.tolist() == [1.0, 0.0]


def test_fully_token_masked_row_excluded_from_stats_but_kept() -> None:
    tm, prev, gen = _rows([[math.log(2.0)], [math.log(4.0)], [5.0]], seq_len=2)
    tm[2] = 0.0  # no loss positions: err 0, not in stats, kept
    out_mask, metrics = compute_seq_logprob_error_metrics(tm, torch.ones(3), prev, gen, T([0.0, 0.0, 0.0]), 3.0)
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(4.0, abs=1e-5)
    assert metrics["mean_seq_mult_prob_error"] == pytest.approx(3.0, abs=1e-5)
    assert metrics["min_seq_mult_prob_error"] == pytest.approx(2.0, abs=1e-5)
    for k in ("max", "mean", "min"):
        assert metrics[f"{k}_seq_mult_prob_error_after_mask"] == pytest.approx(2.0, abs=1e-5)
    assert out_mask.tolist() == [1.0, 0.0, 1.0]
    assert metrics["masked_correct_pct"] == 0.0


def test_empty_batch_gives_zeros() -> None:
    z = torch.zeros(0, 5)
    out_mask, metrics = compute_seq_logprob_error_metrics(z, torch.zeros(0), z, z, torch.zeros(0), 1.5)
    assert out_mask.shape == (0,)
    assert all(v == 0.0 for v in metrics.values())
    assert "num_masked_seqs_by_logprob_error" in metrics


def test_boundary_below_threshold_kept() -> None:
    tm, prev, gen = _rows([[0.4]], seq_len=2)
    out_mask, metrics = compute_seq_logprob_error_metrics(tm, torch.ones(1), prev, gen, T([1.0]), 1.5)
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(math.exp(0.4), abs=1e-6)
    assert out_mask.tolist() == [1.0]


def test_first_position_is_ignored() -> None:
    tm, prev, gen = _rows([[]], seq_len=3)
    gen[0, 0] = -50.0  # position 0 is never a loss position
    _, metrics = compute_seq_logprob_error_metrics(tm, torch.ones(1), prev, gen, None, None)
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(1.0)


def test_logprob_error_alarm_fires_only_above_its_bound():
    from relayrl.algorithms.logprob_error import logprob_error_alarm
    from relayrl.config import GenerationConfig

    gen = GenerationConfig(logprob_error_bound=1.05)
    assert logprob_error_alarm({"token_mult_prob_error": 1.05}, gen, 3) is None  # at the bound: fine
    assert logprob_error_alarm({}, gen, 3) is None  # a step without generation log-probs
    line = logprob_error_alarm({"token_mult_prob_error": 1.0625}, gen, 3)
    assert line is not None and "at step 3: token_mult_prob_error 1.0625 is above" in line and "\n" not in line
    stale = {"token_mult_prob_error": 9.0, "async/trajectory_age_mean": 1.0}  # older weights generated these rows
    assert logprob_error_alarm(stale, gen, 3) is None
    assert logprob_error_alarm({**stale, "async/trajectory_age_mean": 0.0}, gen, 3) is not None
    off = GenerationConfig(logprob_error_bound=1.05, logprob_error_alarm="off")
    assert logprob_error_alarm({"token_mult_prob_error": 9.0}, off, 3) is None

"""Clipped MSE value loss (hand-computed loss, clip fraction, gradients, micro-batch additivity) and the critic
metric reduction (explained variance, extrema, averaged and summed keys)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from relayrl.algorithms.interfaces import LossType, MetricNormalizer
from relayrl.algorithms.value_loss import MseValueLossFn, explained_variance, reduce_critic_metrics

T = torch.tensor


def _hand_batch() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """4 valid tokens: (0,1), (0,2), (1,0), (1,1); the masked ones carry large errors that must not count."""
    v = T([[0.0, 1.0, 2.0], [0.5, 0.5, 0.5]])
    data = {
        "returns": T([[9.0, 1.0, 1.0], [1.0, 0.0, 3.0]]),
        "values": T([[0.0, 0.8, 2.5], [0.5, 0.2, 0.2]]),
        "token_mask": T([[0, 1, 1], [1, 1, 0]]),
        "sample_mask": T([1, 1]),
    }
    return v, data


def _n_toks(data: dict[str, torch.Tensor]) -> torch.Tensor:
    return (data["token_mask"] * data["sample_mask"][:, None]).sum().float()


def _random_batch(seed: int = 0, b: int = 6, s: int = 7) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(b, s, generator=g, dtype=torch.float64)
    data = {
        "returns": torch.randn(b, s, generator=g, dtype=torch.float64),
        "values": v + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64),
        "token_mask": (torch.rand(b, s, generator=g) > 0.3).long(),
        "sample_mask": T([1, 1, 0, 1, 1, 1]),
    }
    return v, data


def test_unclipped_hand_computed() -> None:
    v, data = _hand_batch()
    v.requires_grad_(True)
    fn = MseValueLossFn()
    loss, m = fn(v, data, T(2.0), _n_toks(data))
    # squared errors on valid tokens: 0, 1, 0.25, 0.25 -> 0.5 * 1.5 / 4
    assert loss.item() == pytest.approx(0.1875)
    assert m["loss"] == pytest.approx(0.1875)
    assert m["vf_clipfrac"] == 0.0
    assert m["returns_mean"] == pytest.approx(0.75)
    assert m["values_mean"] == pytest.approx(1.0)
    assert m["returns_sq_mean"] == pytest.approx(0.75)
    assert m["residual_sq_mean"] == pytest.approx(0.375)
    assert (m["values_min"], m["values_max"]) == (0.5, 2.0)
    assert m["num_valid_samples"] == 2.0
    loss.backward()
    assert v.grad is not None
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.25])  # (v - R) / N_t
    assert v.grad[1].tolist() == pytest.approx([-0.125, 0.125, 0.0])


def test_clipped_hand_computed() -> None:
    v, data = _hand_batch()
    v.requires_grad_(True)
    loss, m = MseValueLossFn(value_clip=0.1)(v, data, T(2.0), _n_toks(data))
    # v_clip: (0,1) 0.9 -> 0.01 > 0 (clipped wins); (0,2) 2.4 -> 1.96 > 1 (clipped wins);
    # (1,0) 0.5 -> tie 0.25; (1,1) 0.3 -> 0.09 < 0.25 (unclipped wins). Sum 2.47 -> 0.5 * 2.47 / 4.
    assert loss.item() == pytest.approx(0.30875)
    assert m["vf_clipfrac"] == pytest.approx(0.5)
    assert m["residual_sq_mean"] == pytest.approx(0.375)  # moments use the unclipped predictions
    loss.backward()
    assert v.grad is not None
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0])  # clamped predictions carry no gradient
    assert v.grad[1].tolist() == pytest.approx([-0.125, 0.125, 0.0])


def test_interface_attributes() -> None:
    fn = MseValueLossFn()
    assert fn.loss_type == LossType.TOKEN_LEVEL
    assert fn.metric_normalizations["loss"] == MetricNormalizer.TOKENS
    assert fn.metric_normalizations["values_min"] == MetricNormalizer.NONE
    _, m = fn(*_hand_batch(), T(2.0), T(4.0))
    assert set(m) == set(fn.metric_normalizations)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clipped_at_least_unclipped_and_scale_doubles(seed: int) -> None:
    v, data = _random_batch(seed)
    n_t = _n_toks(data)
    plain, _ = MseValueLossFn()(v, data, T(5.0), n_t)
    clipped, m = MseValueLossFn(value_clip=0.05)(v, data, T(5.0), n_t)
    assert clipped.item() > plain.item() > 0
    assert 0 < m["vf_clipfrac"] <= 1
    doubled, _ = MseValueLossFn(scale=2.0)(v, data, T(5.0), n_t)
    assert doubled.item() == pytest.approx(2 * plain.item(), rel=1e-12)
    zero_clip, _ = MseValueLossFn(value_clip=0.0)(v, data, T(5.0), n_t)
    assert zero_clip.item() == plain.item()


def test_sample_mask_excludes_row() -> None:
    v, data = _hand_batch()
    data["sample_mask"] = T([0, 1])
    loss, m = MseValueLossFn()(v, data, T(1.0), T(2.0))
    assert loss.item() == pytest.approx(0.5 * 0.5 / 2)  # only row 1: 0.25 + 0.25
    assert m["num_valid_samples"] == 1.0
    assert (m["values_min"], m["values_max"]) == (0.5, 0.5)


def test_perfect_prediction_and_3d_input() -> None:
    v, data = _random_batch(3)
    data["returns"] = v.clone()
    loss, m = MseValueLossFn()(v.unsqueeze(-1), data, T(5.0), _n_toks(data))
    assert loss.dim() == 0 and loss.item() < 1e-6
    assert m["residual_sq_mean"] < 1e-12
    # With a clip the loss is pessimistic: old values away from v keep the clipped term, so the loss stays positive.
    clipped, _ = MseValueLossFn(value_clip=0.2)(v, data, T(5.0), _n_toks(data))
    assert clipped.item() > 1e-3
    data["values"] = v.clone()
    assert MseValueLossFn(value_clip=0.2)(v, data, T(5.0), _n_toks(data))[0].item() < 1e-6
    v3, data3 = _hand_batch()
    a, _ = MseValueLossFn()(v3.unsqueeze(-1), data3, T(2.0), T(4.0))
    assert a.item() == pytest.approx(0.1875)


def test_no_valid_tokens_gives_zero_and_infinite_extrema() -> None:
    v, data = _hand_batch()
    data["sample_mask"] = T([0, 0])
    loss, m = MseValueLossFn()(v, data, T(2.0), T(4.0))
    assert loss.item() == 0.0
    assert m["values_min"] == float("inf") and m["values_max"] == float("-inf")


def test_negative_clip_rejected() -> None:
    with pytest.raises(ValueError):
        MseValueLossFn(value_clip=-0.1)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_micro_batch_sums_equal_full_batch(clip: float | None) -> None:
    v, data = _random_batch(4)
    fn = MseValueLossFn(scale=0.7, value_clip=clip)
    n_s, n_t = data["sample_mask"].sum().float(), _n_toks(data)
    v_full = v.clone().requires_grad_(True)
    full, full_m = fn(v_full, data, n_s, n_t)
    full.backward()
    v_mb = v.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    collected: dict[str, list[Any]] = {}
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        loss, m = fn(v_mb[rows], {k: x[rows] for k, x in data.items()}, n_s, n_t)
        total = total + loss
        for key, value in m.items():
            collected.setdefault(key, []).append(value)
    total.backward()
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    assert v_mb.grad is not None and v_full.grad is not None
    assert torch.allclose(v_mb.grad, v_full.grad, atol=1e-14)
    reduced = reduce_critic_metrics(collected)
    for key in full_m:
        assert reduced[key] == pytest.approx(full_m[key], abs=1e-12), key
    # explained variance from the summed moments equals 1 - Var(R - v) / Var(R) over the valid tokens
    m_all = (data["token_mask"] * data["sample_mask"][:, None]).bool()
    r, p = data["returns"][m_all], v[m_all]
    direct = 1 - (r - p).var(unbiased=False) / r.var(unbiased=False)
    assert reduced["explained_var"] == pytest.approx(direct.item(), abs=1e-10)


# ------------------------------------------------------------------------------------------------ critic metrics
def test_reduce_critic_metrics_reference_example() -> None:
    out = reduce_critic_metrics(
        {
            "lr": [0.1, 0.3],
            "values_min": [-2.0, 1.0],
            "values_max": [0.5, 3.0],
            "num_valid_samples": [2, 3],
            "returns_mean": [0.6, 0.4],
            "values_mean": [0.25, 0.25],
            "returns_sq_mean": [2.0, 3.0],
            "residual_sq_mean": [1.0, 0.25],
        }
    )
    assert out["lr"] == pytest.approx(0.2)
    assert (out["values_min"], out["values_max"]) == (-2.0, 3.0)
    assert out["num_valid_samples"] == 5.0
    # 1 - (1.25 - (1 - 0.5)^2) / (5 - 1^2)
    assert out["explained_var"] == pytest.approx(0.75)


def test_reduce_critic_metrics_perfect_fit_and_averaged_keys() -> None:
    out = reduce_critic_metrics(
        {
            "returns_mean": [2.0],
            "values_mean": [2.0],
            "returns_sq_mean": [4.0],
            "residual_sq_mean": [0.0],
            "grad_norm": [1.0, 3.0],
            "global_valid_toks": [T(10.0), T(10.0)],
            "wd": [0.01, 0.01],
            "loss": [T(0.25), 0.5],
            "values_min": [float("inf"), 1.5],
        }
    )
    assert out["explained_var"] == 1.0
    assert out["grad_norm"] == 2.0
    assert out["global_valid_toks"] == 10.0
    assert out["wd"] == pytest.approx(0.01)
    assert out["loss"] == 0.75
    assert out["values_min"] == 1.5  # non-finite (empty micro-batch) entries are ignored


def test_explained_variance_and_missing_moments() -> None:
    assert explained_variance(1.0, 0.5, 5.0, 1.25) == pytest.approx(0.75)
    assert "explained_var" not in reduce_critic_metrics({"loss": [0.1, 0.2]})


@pytest.mark.parametrize("bad", [["a"], [{"x": 1}], [None], "0.5"])
def test_reduce_critic_metrics_rejects_unknown_types(bad: Any) -> None:
    with pytest.raises(ValueError):
        reduce_critic_metrics({"loss": bad})

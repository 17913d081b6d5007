"""GRPO / Reinforce++ advantage estimators, the config factory, message-level overrides and clipping."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.advantages import (
    GRPOAdvantageEstimator,
    ReinforcePlusPlusAdvantageEstimator,
    apply_advantage_overrides,
    build_advantage_estimator,
    clip_advantages,
)
from relayrl.config import AdvEstimatorConfig, ClippedPGLossConfig, GRPOConfig

T = torch.tensor
R2 = 1 / math.sqrt(2)


def _grpo(normalize: bool = True, loo: bool = False) -> GRPOAdvantageEstimator:
    return GRPOAdvantageEstimator(normalize_rewards=normalize, use_leave_one_out_baseline=loo)


# ------------------------------------------------------------------------------------------------ GRPO
def test_grpo_two_groups_non_loo() -> None:
    adv = _grpo().compute_advantage(T([[0], [0], [1], [1]]), T([2.0, 2.0, 1.0, 3.0]), torch.ones(4, 5))
    assert adv.shape == (4, 5)
    assert adv[:2].abs().max().item() == 0.0
    assert adv[2].tolist() == pytest.approx([-R2] * 5, abs=1e-4)
    assert adv[3].tolist() == pytest.approx([R2] * 5, abs=1e-4)


def test_grpo_output_is_broadcast_view_over_all_positions() -> None:
    mask = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv = _grpo().compute_advantage(T([[5], [5]]), T([1.0, 3.0]), mask)
    assert adv.shape == (2, 3)
    assert adv.stride(1) == 0  # zero-stride: masked positions carry the value too
    assert torch.allclose(adv, T([[-R2] * 3, [R2] * 3]), atol=1e-4)


def test_grpo_ten_rows_mean_zero() -> None:
    adv = _grpo().compute_advantage(torch.zeros(10, 2, dtype=torch.long), torch.arange(10.0), torch.ones(10, 4))
    assert abs(adv.mean().item()) < 1e-5
    # std of 0..9 (unbiased) = sqrt(55/6); row 9: 4.5 / std
    assert adv[9, 0].item() == pytest.approx(4.5 / math.sqrt(55 / 6), abs=1e-4)


def test_grpo_negative_advantages_symmetric() -> None:
    adv = _grpo().compute_advantage(T([[1]] * 3), T([0.0, 2.0, 4.0]), torch.ones(3, 2))
    assert adv[0, 0] < 0 and abs(adv[1, 0].item()) < 1e-6 and adv[2, 0] > 0
    assert adv[0, 0].item() == pytest.approx(-adv[2, 0].item())
    assert adv[2, 0].item() == pytest.approx(1.0, abs=1e-5)  # (4 - 2) / 2


def test_grpo_identical_rewards_give_zero() -> None:
    adv = _grpo().compute_advantage(T([[1]] * 4), T([5.0] * 4), torch.ones(4, 3))
    assert torch.isfinite(adv).all() and adv.abs().max().item() == 0.0


def test_grpo_small_std_not_thresholded() -> None:
    adv = _grpo().compute_advantage(T([[1]] * 2), T([1.0, 1.01]), torch.ones(2, 1))
    assert adv[:, 0].tolist() == pytest.approx([-R2, R2], abs=1e-3)


def test_grpo_unnormalized_is_raw_difference() -> None:
    adv = _grpo(normalize=False).compute_advantage(T([[1]] * 3), T([1.0, 2.0, 6.0]), torch.ones(3, 1))
    assert adv[:, 0].tolist() == pytest.approx([-2.0, -1.0, 3.0])


def test_grpo_loo_std_zero_keeps_raw_difference() -> None:
    # rewards [1, 0, 0] LOO: row 0 sees others [0, 0] -> std 0 -> raw a = 1; rows 1-2 see [1, 0]: a = -0.5 / 0.7071
    adv = _grpo(loo=True).compute_advantage(T([[1]] * 3), T([1.0, 0.0, 0.0]), torch.ones(3, 1))
    assert adv[:, 0].tolist() == pytest.approx([1.0, -0.5 / R2, -0.5 / R2], abs=1e-4)
    # G = 2 with LOO: raw differences r_i - r_j
    adv2 = _grpo(loo=True).compute_advantage(T([[1]] * 2), T([1.0, 0.25]), torch.ones(2, 1))
    assert adv2[:, 0].tolist() == pytest.approx([0.75, -0.75])


def test_grpo_ignores_sample_mask_in_mask_argument() -> None:
    # a masked-out row (all-zero mask) still shapes its siblings' advantages
    mask = T([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    adv = _grpo(normalize=False).compute_advantage(T([[1]] * 3), T([0.0, 3.0, 3.0]), mask)
    assert adv[:, 0].tolist() == pytest.approx([-2.0, 1.0, 1.0])


# ------------------------------------------------------------------------------------------------ Reinforce++
def _rpp(minus_baseline: bool = True, use_kl: bool = False, coef: float = 0.0) -> ReinforcePlusPlusAdvantageEstimator:
    return ReinforcePlusPlusAdvantageEstimator(minus_baseline, use_kl, coef, "k1")


def test_reinforce_pp_whitening_one_group() -> None:
    mask = torch.ones(4, 3)
    adv = _rpp().compute_advantage(T([[0]] * 4), T([0.0, 1.0, 2.0, 3.0]), mask)
    assert adv[:, 0].tolist() == pytest.approx([-1.3416, -0.4472, 0.4472, 1.3416], abs=1e-4)
    assert abs((adv * mask).sum().item() / mask.sum().item()) < 1e-6
    assert all(adv[i, 0] < adv[i + 1, 0] for i in range(3))


def test_reinforce_pp_statistics_use_mask_only() -> None:
    # only row 0 position 1 and row 1 position 1 are valid: values 0 and 2 -> mean 1, biased std 1
    mask = T([[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    adv = _rpp(minus_baseline=False).compute_advantage(T([[0], [1], [2]]), T([0.0, 2.0, 10.0]), mask)
    assert torch.allclose(adv, T([[-1.0, -1.0], [1.0, 1.0], [9.0, 9.0]]), atol=1e-5)


def test_reinforce_pp_kl_in_reward() -> None:
    # k1 per token = logprob - ref; beta 0.5. Rewards equal so only the KL term varies.
    lp = T([[0.0, -1.0, -1.0], [0.0, -1.0, -2.0]])
    ref = T([[0.0, -1.0, -3.0], [0.0, -1.0, -2.0]])  # kl: [[0, 0, 2], [0, 0, 0]]
    mask = T([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    adv = _rpp(minus_baseline=False, use_kl=True, coef=0.5).compute_advantage(
        T([[0], [0]]), T([1.0, 1.0]), mask, logprobs_policy=lp, logprobs_reference=ref
    )
    # pre-whitening valid values [1, 0, 1, 1] -> mean 0.75, biased var 0.1875
    z = 1 / math.sqrt(0.1875)
    assert adv[0, 2].item() == pytest.approx(-0.75 * z, abs=1e-4)
    assert adv[1, 1].item() == pytest.approx(0.25 * z, abs=1e-4)
    no_kl = _rpp(minus_baseline=False, use_kl=False, coef=0.5).compute_advantage(
        T([[0], [0]]), T([1.0, 1.0]), mask, logprobs_policy=lp, logprobs_reference=ref
    )
    assert no_kl.abs().max().item() == 0.0  # identical values whiten to 0 (variance floored at 1e-8)


# ------------------------------------------------------------------------------------------------ factory
def test_build_estimator_inherits_grpo_flags() -> None:
    est = build_advantage_estimator(
        GRPOConfig(normalize_rewards=False, use_leave_one_out_baseline=True), ClippedPGLossConfig()
    )
    assert isinstance(est, GRPOAdvantageEstimator)
    assert est.normalize_rewards is False and est.use_leave_one_out_baseline is True
    cfg = GRPOConfig(adv_estimator=AdvEstimatorConfig(normalize_rewards=True, use_leave_one_out_baseline=False))
    est = build_advantage_estimator(cfg, ClippedPGLossConfig())
    assert est.normalize_rewards is True and est.use_leave_one_out_baseline is False


def test_build_estimator_reinforce_pp_takes_loss_kl_settings() -> None:
    cfg = GRPOConfig(adv_estimator=AdvEstimatorConfig(name="reinforce_plus_plus", minus_baseline=False))
    loss = ClippedPGLossConfig(use_kl_in_reward=True, reference_policy_kl_penalty=0.3, reference_policy_kl_type="k2")
    est = build_advantage_estimator(cfg, loss)
    assert isinstance(est, ReinforcePlusPlusAdvantageEstimator)
    assert (est.minus_baseline, est.use_kl_in_reward, est.kl_coef, est.kl_type) == (False, True, 0.3, "k2")


# ------------------------------------------------------------------------------------------------ post-processing
def test_apply_overrides_materialises_and_keeps_input() -> None:
    base = T([1.5, -0.5]).unsqueeze(-1).expand(-1, 4)  # zero-stride view
    nan = float("nan")
    overrides = T([[nan, -5.0, -5.0, nan], [nan, nan, nan, -7.0]])
    out = apply_advantage_overrides(base, overrides)
    assert out.tolist() == [[1.5, -5.0, -5.0, 1.5], [-0.5, -0.5, -0.5, -7.0]]
    assert out.stride(1) != 0
    assert base.tolist() == [[1.5] * 4, [-0.5] * 4]
    out[0, 0] = 9.0
    assert base[0, 3].item() == 1.5


def test_clip_advantages() -> None:
    adv = T([[-10.0, 15.0, 0.5]])
    assert clip_advantages(adv, -2.0, 3.0).tolist() == [[-2.0, 3.0, 0.5]]
    assert clip_advantages(adv, None, 3.0).tolist() == [[-10.0, 3.0, 0.5]]
    assert clip_advantages(adv, -2.0, None).tolist() == [[-2.0, 15.0, 0.5]]
    assert clip_advantages(adv, None, None) is adv


def test_grpo_estimator_refuses_config_objects_for_its_flags():
    """The reference's `GRPOAdvantageEstimator(estimator_cfg, loss_cfg)`: truthy config objects would turn
    normalisation and leave-one-out on without a word."""
    with pytest.raises(TypeError, match="normalize_rewards must be a bool, got dict"):
        GRPOAdvantageEstimator({"name": "grpo"}, {"reference_policy_kl_penalty": 0.0})  # type: ignore[arg-type]

"""Reward scaling and shaping (DAPO overlong penalty, stop-properly penalty)."""

from __future__ import annotations

import warnings

import pytest
import torch

from relayrl.algorithms.reward_functions import apply_reward_shaping, scale_rewards
from relayrl.config import RewardScalingConfig, RewardShapingConfig

T = torch.tensor


# ------------------------------------------------------------------------------------------------ scaling
def test_scaling_disabled_returns_same_object() -> None:
    r = T([1.0, 5.0])
    out = scale_rewards(r, RewardScalingConfig(enabled=False, target_max=10.0))
    assert out is r and out.tolist() == [1.0, 5.0]


def test_scaling_to_target_range() -> None:
    cfg = RewardScalingConfig(enabled=True, target_min=0.0, target_max=0.7)
    assert scale_rewards(T([1.0, 0.5, 0.8]), cfg).tolist() == pytest.approx([0.7, 0.35, 0.56], abs=1e-6)


def test_scaling_binary_to_symmetric() -> None:
    cfg = RewardScalingConfig(enabled=True, target_min=-1.0, target_max=1.0)
    assert scale_rewards(T([1.0, 0.0, 0.0, 1.0, 0.0]), cfg).tolist() == [1.0, -1.0, -1.0, 1.0, -1.0]


def test_scaling_clamps_out_of_range_with_warning() -> None:
    cfg = RewardScalingConfig(enabled=True, source_min=-2.0, source_max=2.0, target_min=-1.0, target_max=1.0)
    with pytest.warns(UserWarning, match="outside reward_scaling source range"):
        out = scale_rewards(T([-2.8, -0.25, 1.5, 0.5, 2.0, 2.5]), cfg)
    assert out.tolist() == pytest.approx([-1.0, -0.125, 0.75, 0.25, 1.0, 1.0], abs=1e-6)


def test_scaling_rejects_empty_source_range() -> None:
    with pytest.raises(ValueError, match="source_max"):
        scale_rewards(T([0.0]), RewardScalingConfig(enabled=True, source_min=1.0, source_max=1.0))


# ------------------------------------------------------------------------------------------------ DAPO shaping
def _dapo(penalty: float = 0.5) -> RewardShapingConfig:
    return RewardShapingConfig(
        enabled=True, overlong_buffer_length=5, overlong_buffer_penalty=penalty, max_response_length=25
    )


def test_shaping_disabled_is_identity_without_copy() -> None:
    r = T([1.0, 0.0])
    out, unshaped = apply_reward_shaping(r, RewardShapingConfig(), T([100, 100]), None)
    assert out is r and unshaped is None


def test_dapo_short_responses_unchanged() -> None:
    r = T([1.0, 0.5, 0.0])
    out, unshaped = apply_reward_shaping(r, _dapo(), T([3, 15, 20]), None)
    assert out.tolist() == [1.0, 0.5, 0.0]
    assert unshaped is not None and unshaped.tolist() == [1.0, 0.5, 0.0]


def test_dapo_linear_penalty_not_floored() -> None:
    out, _ = apply_reward_shaping(T([1.0, 0.8, 0.6, 0.4]), _dapo(), T([10, 22, 25, 30]), None)
    assert out.tolist() == pytest.approx([1.0, 0.6, 0.1, -0.6], abs=1e-6)


def test_dapo_zero_rewards_and_separate_unshaped_copy() -> None:
    r = torch.zeros(4)
    out, unshaped = apply_reward_shaping(r, _dapo(), T([10, 22, 25, 30]), None)
    assert out.tolist() == pytest.approx([0.0, -0.2, -0.5, -1.0], abs=1e-6)
    assert unshaped is not None and unshaped.tolist() == [0.0] * 4
    assert unshaped.data_ptr() != r.data_ptr()
    assert r.tolist() == [0.0] * 4  # the input is not modified


@pytest.mark.parametrize("missing", ["overlong_buffer_length", "overlong_buffer_penalty", "max_response_length"])
def test_dapo_missing_parameter(missing: str) -> None:
    cfg = _dapo().model_copy(update={missing: None})
    with pytest.raises(ValueError, match="DAPO reward shaping is currently supported"):
        apply_reward_shaping(T([1.0]), cfg, T([3]), None)


def test_dapo_needs_lengths_matching_rewards() -> None:
    with pytest.raises(ValueError, match="Assistant response not found during reward shaping"):
        apply_reward_shaping(T([1.0]), _dapo(), None, None)
    with pytest.raises(ValueError, match="The number of messages in the batch must match the number of rewards"):
        apply_reward_shaping(T([1.0, 0.0, 1.0]), _dapo(), T([3, 4]), None)


def test_shaping_config_defaults() -> None:
    cfg = RewardShapingConfig()
    assert cfg.enabled is False
    assert (cfg.overlong_buffer_length, cfg.overlong_buffer_penalty, cfg.max_response_length) == (None, None, None)
    assert cfg.stop_properly_penalty_coef is None


# ------------------------------------------------------------------------------------------------ stop properly
def _stop(coef: float) -> RewardShapingConfig:
    return RewardShapingConfig(enabled=True, stop_properly_penalty_coef=coef)


def test_stop_properly_penalty(capsys: pytest.CaptureFixture[str]) -> None:
    r = T([1.0, 0.8, 0.6, 0.4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "[WARN]" when the DAPO parameters are unset
        out, unshaped = apply_reward_shaping(r, _stop(0.5), None, T([False, True, False, True]))
    assert out.tolist() == pytest.approx([1.0, 0.4, 0.6, 0.2])
    assert unshaped is not None and unshaped.tolist() == pytest.approx([1.0, 0.8, 0.6, 0.4])
    assert "[WARN]" not in capsys.readouterr().out


def test_stop_properly_coef_bounds() -> None:
    trunc = T([False, True])
    assert apply_reward_shaping(T([1.0, 0.7]), _stop(0.0), None, trunc)[0].tolist() == pytest.approx([1.0, 0.0])
    assert apply_reward_shaping(T([1.0, 0.7]), _stop(1.0), None, trunc)[0].tolist() == pytest.approx([1.0, 0.7])


def test_stop_properly_requires_truncated() -> None:
    with pytest.raises(ValueError, match="truncated field not found"):
        apply_reward_shaping(T([1.0]), _stop(0.5), T([3]), None)


@pytest.mark.parametrize("coef", [-0.1, 1.5])
def test_stop_properly_coef_out_of_range_when_called_directly(coef: float) -> None:
    cfg = RewardShapingConfig.model_construct(enabled=True, stop_properly_penalty_coef=coef)
    with pytest.raises(ValueError, match="stop_properly_penalty_coef must be in"):
        apply_reward_shaping(T([1.0]), cfg, None, T([True]))


def test_stop_properly_ignores_dapo_parameters_with_warning() -> None:
    cfg = _dapo().model_copy(update={"stop_properly_penalty_coef": 0.5})
    with pytest.warns(UserWarning, match="DAPO overlong parameters are ignored"):
        out, _ = apply_reward_shaping(T([1.0, 1.0]), cfg, T([100, 100]), T([True, False]))
    assert out.tolist() == pytest.approx([0.5, 1.0])

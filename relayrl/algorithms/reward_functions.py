"""Reward post-processing applied right after the rollout: linear rescaling, then optional shaping.

Shaping is either the "stop properly" penalty (scale down rewards of truncated responses) or DAPO's soft overlong
penalty. Both return the shaped rewards plus an unshaped copy, which dynamic sampling uses so that groups whose *raw*
rewards agree are still filtered even if shaping made them differ.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from relayrl.config import RewardScalingConfig, RewardShapingConfig, RolloutConfig


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """Clamp to [source_min, source_max] and map linearly onto [target_min, target_max]; disabled is a no-op."""
    if not cfg.enabled:
        return rewards
    s_min, s_max, t_min, t_max = cfg.source_min, cfg.source_max, cfg.target_min, cfg.target_max
    if s_max <= s_min:
        raise ValueError(f"reward_scaling.source_max ({s_max}) must be greater than source_min ({s_min})")
    outside = (rewards < s_min) | (rewards > s_max)
    if bool(outside.any()):
        warnings.warn(
            f"[WARN] {int(outside.sum())} reward(s) outside reward_scaling source range [{s_min}, {s_max}] "
            "were clamped before scaling",
            stacklevel=2,
        )
    clamped = rewards.clamp(min=s_min, max=s_max)
    return t_min + (clamped - s_min) / (s_max - s_min) * (t_max - t_min)  # [B]


def _dapo_params(cfg: RewardShapingConfig) -> tuple[int, float, int]:
    params = {
        "overlong_buffer_length": cfg.overlong_buffer_length,
        "overlong_buffer_penalty": cfg.overlong_buffer_penalty,
        "max_response_length": cfg.max_response_length,
    }
    missing = [name for name, value in params.items() if value is None]
    if missing:
        raise ValueError(
            "Reward shaping is enabled but only DAPO reward shaping is currently supported, which needs "
            f"reward_shaping.overlong_buffer_length, overlong_buffer_penalty and max_response_length (missing: "
            f"{', '.join(missing)}); or set reward_shaping.stop_properly_penalty_coef"
        )
    assert cfg.overlong_buffer_length is not None and cfg.overlong_buffer_penalty is not None
    assert cfg.max_response_length is not None
    return cfg.overlong_buffer_length, cfg.overlong_buffer_penalty, cfg.max_response_length


def apply_reward_shaping(
    rewards: torch.Tensor,  # [B]
    cfg: RewardShapingConfig,
    response_lengths: torch.Tensor | None,  # [B] tokens of the first assistant message
    truncated: torch.Tensor | None,  # [B] bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (shaped rewards, unshaped copy); disabled returns (rewards, None) untouched.

    DAPO: r += min(-(len - (max_len - buffer)) / buffer * penalty, 0). The penalty is deliberately *not* floored at
    -penalty (the reference does not floor it either), so responses longer than max_response_length keep losing.
    """
    if not cfg.enabled:
        return rewards, None
    unshaped = rewards.clone()  # [B], separate storage

    coef = cfg.stop_properly_penalty_coef
    if coef is not None:
        if not 0.0 <= coef <= 1.0:  # pydantic bounds it already; guard direct callers
            raise ValueError(f"stop_properly_penalty_coef must be in [0, 1], got {coef}")
        if truncated is None:
            raise ValueError("truncated field not found: stop_properly_penalty_coef needs per-row truncation flags")
        if any(
            v is not None for v in (cfg.overlong_buffer_length, cfg.overlong_buffer_penalty, cfg.max_response_length)
        ):
            warnings.warn(
                "[WARN] stop_properly_penalty_coef is set, so the DAPO overlong parameters are ignored", stacklevel=2
            )
        trunc = torch.as_tensor(truncated, device=rewards.device).bool()  # [B]
        if trunc.shape != rewards.shape:
            raise ValueError(f"truncated has shape {tuple(trunc.shape)} but rewards have {tuple(rewards.shape)}")
        return torch.where(trunc, rewards * coef, rewards), unshaped

    buffer_len, penalty, max_len = _dapo_params(cfg)
    if response_lengths is None:
        raise ValueError("Assistant response not found during reward shaping: response_lengths is required")
    lengths = torch.as_tensor(response_lengths, device=rewards.device)  # [B]
    if lengths.numel() != rewards.numel():
        raise ValueError(
            "The number of messages in the batch must match the number of rewards: "
            f"{lengths.numel()} response lengths vs {rewards.numel()} rewards"
        )
    exceed = lengths.reshape(rewards.shape).to(torch.float64) - (max_len - buffer_len)  # [B]
    overlong_penalty = (-exceed / buffer_len * penalty).clamp(max=0.0)  # [B], <= 0
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return rewards.to(out_dtype) + overlong_penalty.to(out_dtype), unshaped


def post_process_rewards(
    rewards: torch.Tensor,
    truncated: torch.Tensor,
    response_lengths: Callable[[], torch.Tensor],
    r: RolloutConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reward scaling, then shaping (the reference's order). Returns (rewards, unshaped copy or None).

    `response_lengths` is called only when shaping needs the first assistant turn's length of every row.
    """
    rewards = scale_rewards(rewards, r.reward_scaling)
    if not r.reward_shaping.enabled:
        return rewards, None
    return apply_reward_shaping(rewards, r.reward_shaping, response_lengths(), truncated)

"""Advantage estimators (GRPO, Reinforce++) and the GRPO advantage post-processing (overrides, clipping).

Estimators turn one scalar reward per row into token-aligned advantages [B, S]. GRPO returns the per-row value
broadcast over every position (a zero-stride view): the loss mask, not the estimator, removes prompt and padding
positions.
"""

from __future__ import annotations

from typing import Protocol

import torch

from relayrl.algorithms.utils import calculate_baseline_and_std_per_prompt, calculate_kl
from relayrl.config import ClippedPGLossConfig, GRPOConfig, MasterConfig


class AdvantageEstimator(Protocol):
    def compute_advantage(
        self,
        prompt_ids: torch.Tensor,  # [B, P]
        rewards: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, S]
        logprobs_policy: torch.Tensor | None = None,  # [B, S]
        logprobs_reference: torch.Tensor | None = None,  # [B, S]
    ) -> torch.Tensor: ...  # [B, S]


class GRPOAdvantageEstimator:
    """a_i = (r_i - group baseline) [/ (group std + epsilon) where std > 0], broadcast over the sequence.

    The sample mask is deliberately not used for the group statistics: filtered (e.g. truncated) rows still shape
    their siblings' advantages, as in the reference.
    """

    def __init__(self, normalize_rewards: bool, use_leave_one_out_baseline: bool, epsilon: float = 1e-6) -> None:
        for name, flag in (
            ("normalize_rewards", normalize_rewards),
            ("use_leave_one_out_baseline", use_leave_one_out_baseline),
        ):
            if not isinstance(flag, bool):  # the reference's (estimator_cfg, loss_cfg) would turn both on, silently
                raise TypeError(
                    f"GRPOAdvantageEstimator's {name} must be a bool, got {type(flag).__name__}; build it from a config "
                    "with build_advantage_estimator(grpo_cfg, loss_cfg)"
                )
        self.normalize_rewards = normalize_rewards
        self.use_leave_one_out_baseline = use_leave_one_out_baseline
        self.epsilon = epsilon

    def compute_advantage(
        self,
        prompt_ids: torch.Tensor,  # [B, P]
        rewards: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, S]
        logprobs_policy: torch.Tensor | None = None,
        logprobs_reference: torch.Tensor | None = None,
    ) -> torch.Tensor:
        baseline, std = calculate_baseline_and_std_per_prompt(
            prompt_ids, rewards, torch.ones_like(rewards), leave_one_out_baseline=self.use_leave_one_out_baseline
        )  # [B], [B]
        adv = rewards.to(baseline.dtype) - baseline  # [B]
        if self.normalize_rewards:
            # Rows whose std is 0 keep the raw difference (0 for a uniform group; non-zero only under LOO).
            adv = torch.where(std > 0, adv / (std + self.epsilon), adv)
        return adv.unsqueeze(-1).expand(-1, mask.shape[1])  # [B, S] zero-stride view


class ReinforcePlusPlusAdvantageEstimator:
    """Reinforce++: (r - group mean) [- beta * per-token KL], then whitened over all masked tokens of the batch."""

    def __init__(self, minus_baseline: bool, use_kl_in_reward: bool, kl_coef: float, kl_type: str) -> None:
        self.minus_baseline = minus_baseline
        self.use_kl_in_reward = use_kl_in_reward
        self.kl_coef = kl_coef
        self.kl_type = kl_type

    def compute_advantage(
        self,
        prompt_ids: torch.Tensor,  # [B, P]
        rewards: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, S]
        logprobs_policy: torch.Tensor | None = None,  # [B, S]
        logprobs_reference: torch.Tensor | None = None,  # [B, S]
    ) -> torch.Tensor:
        rewards_f = rewards if rewards.is_floating_point() else rewards.float()
        if self.minus_baseline:
            baseline, _ = calculate_baseline_and_std_per_prompt(
                prompt_ids, rewards_f, torch.ones_like(rewards_f), leave_one_out_baseline=False
            )
            adv = rewards_f - baseline  # [B]
        else:
            adv = rewards_f
        adv = adv.unsqueeze(-1).expand(-1, mask.shape[1])  # [B, S]
        if self.use_kl_in_reward and logprobs_policy is not None and logprobs_reference is not None:
            kl = calculate_kl(logprobs_policy, logprobs_reference, self.kl_type, 20.0, 10.0)  # [B, S]
            adv = adv - self.kl_coef * kl.detach()

        maskf = mask.to(adv.dtype)  # [B, S]
        count = maskf.sum()
        if count == 0:
            return adv.clone()  # nothing to whiten over; every position is masked anyway
        mean = (adv * maskf).sum() / count
        var = ((adv - mean).square() * maskf).sum() / count  # biased, as in the reference
        return (adv - mean) * torch.rsqrt(var.clamp(min=1e-8))  # [B, S]


def build_advantage_estimator(grpo_cfg: GRPOConfig, loss_cfg: ClippedPGLossConfig) -> AdvantageEstimator:
    """Pick the estimator named by grpo.adv_estimator; unset estimator fields inherit the grpo-level flags."""
    adv_cfg = grpo_cfg.adv_estimator
    if adv_cfg.name == "grpo":
        normalize = adv_cfg.normalize_rewards
        loo = adv_cfg.use_leave_one_out_baseline
        return GRPOAdvantageEstimator(
            normalize_rewards=grpo_cfg.normalize_rewards if normalize is None else normalize,
            use_leave_one_out_baseline=grpo_cfg.use_leave_one_out_baseline if loo is None else loo,
            epsilon=grpo_cfg.normalize_rewards_epsilon,
        )
    if adv_cfg.name == "reinforce_plus_plus":
        return ReinforcePlusPlusAdvantageEstimator(
            minus_baseline=adv_cfg.minus_baseline,
            use_kl_in_reward=loss_cfg.use_kl_in_reward,
            kl_coef=loss_cfg.reference_policy_kl_penalty,
            kl_type=loss_cfg.reference_policy_kl_type,
        )
    raise ValueError(f"Unknown advantage estimator {adv_cfg.name!r}; expected 'grpo' or 'reinforce_plus_plus'")


#: Message-level advantage keys (`grpo.<key>`, the reference's names, or `reward_penalties.<key>`) -> message flag.
MESSAGE_ADVANTAGE_FLAGS = {
    "invalid_tool_call_advantage": "is_invalid_tool_call",
    "malformed_thinking_advantage": "has_malformed_thinking",
}


def message_level_advantages(cfg: MasterConfig) -> dict[str, float]:
    """Message flag -> advantage of the configured message-level penalties, first match winning: the
    `reward_penalties.flag_advantages`, then invalid tool calls, then malformed thinking (each set as `grpo.<key>`
    or `reward_penalties.<key>`)."""
    out = dict(cfg.reward_penalties.flag_advantages)
    for key, flag in MESSAGE_ADVANTAGE_FLAGS.items():
        value = getattr(cfg.grpo, key)
        if value is None:
            value = getattr(cfg.reward_penalties, key)
        if value is not None:
            out[flag] = value
    return out


def message_level_advantage_keys(cfg: MasterConfig) -> list[str]:
    """The message-level penalty keys a config sets, named as it sets them (`grpo.<key>`, `reward_penalties.<key>`)."""
    names = [f"grpo.{key}" for key in MESSAGE_ADVANTAGE_FLAGS if getattr(cfg.grpo, key) is not None]
    return names + [f"reward_penalties.{key}" for key in cfg.reward_penalties.enabled_keys()]


def apply_advantage_overrides(advantages: torch.Tensor, overrides: torch.Tensor) -> torch.Tensor:
    """Message-level penalties: where `overrides` is not NaN its value replaces the advantage.

    Always returns a fresh, materialised tensor (the estimator's output may be a zero-stride broadcast view, and
    writing into one would change every position of the row); the input is never modified.
    """
    overrides = overrides.to(device=advantages.device, dtype=advantages.dtype)  # [B, S]
    return torch.where(torch.isnan(overrides), advantages, overrides).contiguous()  # [B, S]


def clip_advantages(advantages: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """clamp(min=low) then clamp(max=high); each bound is optional and both unset returns the input as is."""
    if low is not None:
        advantages = advantages.clamp(min=low)
    if high is not None:
        advantages = advantages.clamp(max=high)
    return advantages


def advantage_metrics(
    advantages: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor, valid_values: torch.Tensor | None = None
) -> dict[str, float]:
    """Summary statistics the reference logs under train/advantages/* and train/baseline_reward/*.

    `valid_values` may replace `advantages[mask.bool()]` when the caller has the loss-token values already.
    """
    valid = advantages[mask.bool()] if valid_values is None else valid_values
    out = {
        "advantages/mean": valid.mean().item() if valid.numel() else 0.0,
        "advantages/max": valid.max().item() if valid.numel() else 0.0,
        "advantages/min": valid.min().item() if valid.numel() else 0.0,
        "advantages/sum": advantages.sum().item(),
    }
    n = max(baseline.numel(), 1)
    out["baseline_reward/pct_0"] = 100.0 * (baseline == 0).sum().item() / n
    out["baseline_reward/pct_1"] = 100.0 * (baseline == 1).sum().item() / n
    out["baseline_reward/pct_mixed"] = 100.0 - out["baseline_reward/pct_0"] - out["baseline_reward/pct_1"]
    return out


def row_advantage_metrics(
    adv_rows: torch.Tensor, valid_counts: torch.Tensor, baseline: torch.Tensor, width: int
) -> dict[str, float]:
    """`advantage_metrics` from per-row advantages [B], equal to the per-token statistics of the broadcast [B, S]
    tensor: the loss-token values are each row's advantage repeated over its loss tokens, in row order."""
    valid = adv_rows.repeat_interleave(valid_counts)  # == advantages[mask.bool()] of the broadcast [B, S] tensor
    full = adv_rows.unsqueeze(-1).expand(-1, width)  # [B, S] broadcast, as the legacy estimator returns it
    return advantage_metrics(full, torch.zeros(0), baseline, valid_values=valid)

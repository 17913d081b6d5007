"""The algorithm blocks: what GRPO and PPO share (`RolloutConfig`), `grpo`, `ppo`, rewards and advantage
estimators, and the message-level `reward_penalties`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from relayrl.config.base import NonNegFloat, NonNegInt, Strict


# ---------------------------------------------------------------------------------------------------- grpo
class RewardScalingConfig(Strict):
    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


class RewardShapingConfig(Strict):
    enabled: bool = False
    overlong_buffer_length: PositiveInt | None = None
    overlong_buffer_penalty: NonNegFloat | None = None
    max_response_length: PositiveInt | None = None
    stop_properly_penalty_coef: Annotated[float, Field(ge=0, le=1)] | None = None


class AdvEstimatorConfig(Strict):
    name: Literal["grpo", "reinforce_plus_plus"] = "grpo"
    normalize_rewards: bool | None = None
    """None means grpo.normalize_rewards."""
    use_leave_one_out_baseline: bool | None = None
    """None means grpo.use_leave_one_out_baseline."""
    minus_baseline: bool = True


class RolloutConfig(Strict):
    """What GRPO and PPO share: how a step's rollouts are drawn, validated, scored and filtered.

    The `grpo` and `ppo` blocks both extend it (their YAML keys are unchanged), so the rollout, validation, data and
    step-tail code reads one type, `MasterConfig.rollout`, and the derived quantities are defined once, here.
    """

    num_prompts_per_step: PositiveInt = 16
    num_generations_per_prompt: PositiveInt = 8
    max_rollout_turns: PositiveInt = 1
    max_num_epochs: PositiveInt = 1000
    max_num_steps: PositiveInt = 1000
    val_period: NonNegInt = 50
    val_start_at: int = -1
    val_at_start: bool = True
    val_at_end: bool = True
    val_greedy: bool = True
    """Validate with greedy decoding (deterministic accuracy); False samples like training."""
    max_val_samples: PositiveInt = 200
    val_batch_size: PositiveInt = 200
    val_num_generations_per_prompt: PositiveInt = 1
    stop_at_validation_metric: str | None = None
    stop_at_validation_threshold: float | None = None
    seed: int = 42
    overlong_filtering: bool = False
    reward_scaling: RewardScalingConfig = RewardScalingConfig()
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    seq_logprob_error_threshold: PositiveFloat | None = None
    skip_reference_policy_logprobs_calculation: bool = False
    non_finite: Literal["stop", "skip"] = "stop"
    """A NaN or infinite reward or advantage: `stop` ends the run before that step changes any weight, naming the
    step and samples; `skip` drops the offending samples' groups from the step and counts them
    (`train/non_finite_samples_skipped`)."""

    @property
    def rows_per_step(self) -> int:
        """Samples trained on per step: every prompt of the step times its generations."""
        return self.num_prompts_per_step * self.num_generations_per_prompt

    @property
    def prompts_per_batch(self) -> int:
        """Prompts the train loader yields per generation batch."""
        return self.num_prompts_per_step


class GRPOConfig(RolloutConfig):
    normalize_rewards: bool = True
    normalize_rewards_epsilon: PositiveFloat = 1e-6
    """Added to the group's reward std when advantages are normalized, a = (r - mean) / (std + epsilon); TRL's GRPO
    uses 1e-4 (docs/trl_mapping.md)."""
    use_leave_one_out_baseline: bool = False
    advantage_clip_low: float | None = None
    advantage_clip_high: float | None = None
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: NonNegInt = 10
    batch_multiplier: PositiveInt = 1
    adv_estimator: AdvEstimatorConfig = AdvEstimatorConfig()
    skip_prev_logprobs_when_on_policy: bool = True
    """When a step is exactly one optimizer step on fresh rollouts, the old-policy logprobs equal the training
    forward's detached logprobs: skip the separate pass and use ratio = exp(logp - logp.detach()) (what TRL does).
    Off when seq_logprob_error_threshold is set, or with CISPO / REINFORCE losses, which need them."""
    invalid_tool_call_advantage: float | None = None
    """Message-level advantage penalty (legacy trainer): assistant messages flagged `is_invalid_tool_call` get this
    advantage. The reference's key; the same setting as reward_penalties.invalid_tool_call_advantage (set one)."""
    malformed_thinking_advantage: float | None = None
    """As invalid_tool_call_advantage, for messages flagged `has_malformed_thinking`."""

    @property
    def prompts_per_batch(self) -> int:
        """Dynamic sampling draws `batch_multiplier` times the prompts, since zero-std groups are dropped."""
        return self.num_prompts_per_step * (self.batch_multiplier if self.use_dynamic_sampling else 1)


class RewardPenaltiesConfig(Strict):
    """Message-level advantage penalties: an assistant message flagged by the environment gets this advantage."""

    invalid_tool_call_advantage: float | None = None
    """Advantage for messages flagged `is_invalid_tool_call`."""
    malformed_thinking_advantage: float | None = None
    """Advantage for messages flagged `has_malformed_thinking`."""
    flag_advantages: dict[str, float] = {}
    """Any other flag name -> advantage."""

    def enabled_keys(self) -> list[str]:
        keys = [
            k for k in ("invalid_tool_call_advantage", "malformed_thinking_advantage") if getattr(self, k) is not None
        ]
        keys += [f"flag_advantages.{k}" for k in self.flag_advantages]
        return keys

    def flag_to_advantage(self) -> dict[str, float]:
        out = dict(self.flag_advantages)
        if self.invalid_tool_call_advantage is not None:
            out["is_invalid_tool_call"] = self.invalid_tool_call_advantage
        if self.malformed_thinking_advantage is not None:
            out["has_malformed_thinking"] = self.malformed_thinking_advantage
        return out


class PPOAdvEstimatorConfig(Strict):
    name: Literal["gae", "raw_reward"] = "gae"
    gae_lambda: Annotated[float, Field(ge=0, le=1)] = 0.95
    gae_gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    normalize_advantages: bool = True
    gae_lambda_value: Annotated[float, Field(ge=0, le=1)] | None = None
    """Decoupled lambda for the critic's returns (VAPO); None means gae_lambda."""
    gae_lambda_policy: Annotated[float, Field(ge=0, le=1)] | None = None
    """Decoupled lambda for the actor's advantages; None means gae_lambda."""
    length_adaptive_alpha: NonNegFloat | None = None
    """Per-row policy lambda 1 - 1/(alpha * length) (VAPO); None disables it."""


class PPOConfig(RolloutConfig):
    max_num_steps: PositiveInt = 200
    ppo_epochs: PositiveInt = 1
    """Policy and value updates per rollout batch (all reuse the same advantages and old logprobs)."""
    policy_training_start_step: NonNegInt = 0
    """Critic warm-up: train only the value model until this many steps have run."""
    adv_estimator: PPOAdvEstimatorConfig = PPOAdvEstimatorConfig()

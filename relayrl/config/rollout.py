"""The algorithm blocks: what GRPO and PPO share (`RolloutConfig`), `grpo`, `ppo`, rewards and advantage
estimators, and the message-level `reward_penalties`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from relayrl.config.base import NonNegFloat, NonNegInt, Strict


# ---------------------------------------------------------------------------------------------------- grpo
class RewardScalingConfig(Strict):
    """Linear reward rescaling, applied right after the rollout and before shaping."""

    enabled: bool = False
    """Clamp every reward into [source_min, source_max] (warning when any was outside) and map it linearly onto
    [target_min, target_max]."""
    source_min: float = 0.0
    """Lower end of the expected reward range (maps to target_min); must be below source_max."""
    source_max: float = 1.0
    """Upper end of the expected reward range (maps to target_max)."""
    target_min: float = 0.0
    """What a reward of source_min becomes."""
    target_max: float = 1.0
    """What a reward of source_max becomes."""


class RewardShapingConfig(Strict):
    """Length-based reward shaping after scaling: DAPO's soft overlong penalty, or a factor on truncated responses."""

    enabled: bool = False
    """Shape rewards: with stop_properly_penalty_coef set, scale truncated rows; otherwise the DAPO overlong
    penalty, which needs the three overlong keys. Dynamic sampling still judges groups on the unshaped rewards."""
    overlong_buffer_length: PositiveInt | None = None
    """DAPO: tokens before max_response_length where the penalty starts; the reward drops by
    (length - (max_response_length - buffer)) / buffer x overlong_buffer_penalty, not floored."""
    overlong_buffer_penalty: NonNegFloat | None = None
    """DAPO: penalty reached at exactly max_response_length (it keeps growing beyond it)."""
    max_response_length: PositiveInt | None = None
    """DAPO: the response length, in tokens of the first assistant message, at which the full penalty applies."""
    stop_properly_penalty_coef: Annotated[float, Field(ge=0, le=1)] | None = None
    """Multiply the reward of truncated rows (length limit hit) by this; when set the DAPO keys are ignored (with a
    warning). None: DAPO shaping."""


class AdvEstimatorConfig(Strict):
    """GRPO's advantage estimator: one scalar per row, broadcast over its tokens."""

    name: Literal["grpo", "reinforce_plus_plus"] = "grpo"
    """`grpo`: reward minus the group baseline, optionally over the group std. `reinforce_plus_plus`: reward minus
    the group mean (see minus_baseline), optionally minus beta x KL (loss_fn.use_kl_in_reward), whitened over the
    batch's valid tokens."""
    normalize_rewards: bool | None = None
    """grpo estimator: divide by the group's reward std (+1e-6) where it is > 0. None means grpo.normalize_rewards."""
    use_leave_one_out_baseline: bool | None = None
    """grpo estimator: each row's baseline (and std) from the other rows of its group. None means
    grpo.use_leave_one_out_baseline."""
    minus_baseline: bool = True
    """reinforce_plus_plus only: subtract the group mean reward before whitening; false whitens the raw rewards."""


class RolloutConfig(Strict):
    """What GRPO and PPO share: how a step's rollouts are drawn, validated, scored and filtered.

    The `grpo` and `ppo` blocks both extend it (their YAML keys are unchanged), so the rollout, validation, data and
    step-tail code reads one type, `MasterConfig.rollout`, and the derived quantities are defined once, here.
    """

    num_prompts_per_step: PositiveInt = 16
    """Prompts per training step (the train loader's batch; times batch_multiplier under dynamic sampling)."""
    num_generations_per_prompt: PositiveInt = 8
    """Rollouts sampled per prompt (the group size); rows per step = num_prompts_per_step x this. GRPO needs >= 2."""
    max_rollout_turns: PositiveInt = 1
    """Most generate-then-environment turns per rollout (1: single turn); a row also ends when its environment
    says so or the context limit is hit. Rewards of all turns are summed."""
    max_num_epochs: PositiveInt = 1000
    """Passes over the training prompts; the run ends at whichever of this and max_num_steps comes first."""
    max_num_steps: PositiveInt = 1000
    """Training steps of the run (counted across resumes); also the default LR-decay horizon."""
    val_period: NonNegInt = 50
    """Validate after every step divisible by this (0: no periodic validation)."""
    val_start_at: int = -1
    """Periodic validation only from this step on (-1: from the first)."""
    val_at_start: bool = True
    """Validate before the first step when the run starts at step 0 (not on resume)."""
    val_at_end: bool = True
    """Validate after the last step even when it is not a val_period multiple."""
    val_greedy: bool = True
    """Validate with greedy decoding (deterministic accuracy); False samples like training."""
    max_val_samples: PositiveInt = 200
    """Validation prompts per validation (the first ones of the validation set); a multiple of val_batch_size when
    larger than it."""
    val_batch_size: PositiveInt = 200
    """Validation prompts rolled out together in one batch."""
    val_num_generations_per_prompt: PositiveInt = 1
    """Rollouts per validation prompt; above 1 validation also reports pass_k (any of them rewarded)."""
    val_pass_k: PositiveInt | None = None
    """The k of the pass_k validation metric: the unbiased estimate 1 - C(n-c,k)/C(n,k) over each prompt's n
    rollouts (c rewarded), averaged over prompts. None: k = val_num_generations_per_prompt (any of them rewarded)."""
    stop_at_validation_metric: str | None = None
    """End the run after a validation where this metric (accuracy, avg_length, num_samples or pass_k) reached
    stop_at_validation_threshold. None: no early stop."""
    stop_at_validation_threshold: float | None = None
    """Early-stop when stop_at_validation_metric >= this; required when the metric is set."""
    seed: int = 42
    """Seeds Python, NumPy and torch, the train loader's shuffle, the sampling generator and the
    data.train.split_validation_size split."""
    overlong_filtering: bool = False
    """Truncated rollouts (length limit hit) get sample mask 0: no loss or gradient from them, though in GRPO they
    still count in their group's baseline and std."""
    reward_scaling: RewardScalingConfig = RewardScalingConfig()
    """Linear rescaling of the rewards (off by default)."""
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    """Length-based reward shaping (off by default)."""
    seq_logprob_error_threshold: PositiveFloat | None = None
    """Drop (sample mask 0) sequences whose mean exp(|generation logprob - training logprob|) over trained tokens
    exceeds this. None: the error is only logged. Forces the old-policy log-prob pass."""
    skip_reference_policy_logprobs_calculation: bool = False
    """Skip the reference-policy log-prob pass. Requires loss_fn.reference_policy_kl_penalty == 0, where that
    pass is already skipped, so it only states the intent."""
    non_finite: Literal["stop", "skip"] = "stop"
    """A NaN or infinite reward or advantage: `stop` ends the run before that step changes any weight, naming the
    step and samples; `skip` drops the offending samples' groups from the step and counts them
    (`train/non_finite_samples_skipped`)."""
    use_dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop the rows of every prompt whose rewards all agree (group std 0: no learning signal)
    and generate more batches until num_prompts_per_step x num_generations_per_prompt rows remain; the surplus is
    discarded. Needs num_generations_per_prompt >= 2. PPO's critic then sees only the kept rows."""
    dynamic_sampling_max_gen_batches: NonNegInt = 10
    """Dynamic sampling: the step fails when it is still short of rows after more than this many generation
    batches."""
    batch_multiplier: PositiveInt = 1
    """Dynamic sampling: each generation batch draws num_prompts_per_step x this prompts, to refill faster after
    filtering. Must be 1 without use_dynamic_sampling."""

    @property
    def rows_per_step(self) -> int:
        """Samples trained on per step: every prompt of the step times its generations."""
        return self.num_prompts_per_step * self.num_generations_per_prompt

    @property
    def prompts_per_batch(self) -> int:
        """Prompts the train loader yields per generation batch: dynamic sampling draws `batch_multiplier` times
        them, since groups without reward spread are dropped."""
        return self.num_prompts_per_step * (self.batch_multiplier if self.use_dynamic_sampling else 1)


class AsyncGRPOConfig(Strict):
    """`grpo.async_grpo`: generation runs ahead of training under a staleness bound (`algorithms.grpo_async`)."""

    enabled: bool = False
    """Use the asynchronous trainer: a producer generates the next batches while the current step trains. Needs
    data_plane.enabled=true. Local executor: any data_plane.backend; the engine decodes in a child process (see
    `generator`). Ray executor: the ray backend and dedicated generation workers
    (policy.generation.colocated.enabled=false), which the producer drives while the training workers train."""
    max_trajectory_age_steps: NonNegInt = 1
    """Staleness bound d: batch k is generated by the weights after step k - 1 - d (d = 0 is exactly the sync
    trainer; d = 1 lets generation of the next batch overlap the current step's training). Larger d hides slower
    generation but trains on older samples (corrected by importance sampling)."""
    reference_pass: Literal["auto", "producer", "trainer"] = "auto"
    """Where the frozen reference model's log-probs of a batch are computed (they do not depend on training, and the
    values are the same wherever they run). `producer`: right after generation, off the training side. `trainer`: in
    the step, as the sync trainer does. `auto`: on the producer unless the trainer is already waiting for that batch,
    then in the step, so the pass goes to whichever side has time (on a large model the producer is ahead and does
    them; on a tiny one the step does). Under LoRA (the reference is the live module with its adapters off) always
    in the step."""
    generator: Literal["process", "thread"] = "process"
    """Where the producer's generation engine decodes. `process`: a child process with its own interpreter (CPU), so
    decoding runs beside training instead of taking turns with it on Python's interpreter lock; it samples the same
    tokens as `thread`. `thread`: in the producer thread (always so on a GPU, where the engine has its own stream)."""
    generation_threads: PositiveInt | None = None
    """torch intra-op threads of the generation process (generator=process); None: cluster.torch_num_threads. The
    trainer keeps cluster.torch_num_threads, so on a 2-core CPU 1 + 1 gives each side a core."""
    in_flight_weight_updates: bool = False
    """Refit the generator while a batch is being generated (the reference's async-engine mode). The local
    generator finishes a batch on the weights it started with, so only false is accepted."""


class GRPOConfig(RolloutConfig):
    """GRPO: the shared rollout settings plus group-relative advantages, their clipping and dynamic sampling."""

    normalize_rewards: bool = True
    """Divide each advantage by its group's reward std (+ normalize_rewards_epsilon) where that std is > 0; the
    default for adv_estimator.normalize_rewards."""
    normalize_rewards_epsilon: PositiveFloat = 1e-6
    """Added to the group's reward std when advantages are normalized, a = (r - mean) / (std + epsilon); TRL's GRPO
    uses 1e-4 (docs/trl_mapping.md)."""
    use_leave_one_out_baseline: bool = False
    """RLOO: baseline and std of each row from the other rows of its group. The default for
    adv_estimator.use_leave_one_out_baseline; also sets the std dynamic sampling filters on and the logged baseline."""
    advantage_clip_low: float | None = None
    """Clamp advantages from below at this after normalisation (None: no lower clip); <= advantage_clip_high."""
    advantage_clip_high: float | None = None
    """Clamp advantages from above at this after normalisation (None: no upper clip)."""
    adv_estimator: AdvEstimatorConfig = AdvEstimatorConfig()
    """Which advantage estimator GRPO uses and its options."""
    skip_prev_logprobs_when_on_policy: bool = True
    """When a step is exactly one optimizer step, the old policy is the weights the training forward runs with, so
    its detached logprobs are the old-policy logprobs: skip the separate pass and use ratio = exp(logp -
    logp.detach()) (what TRL does). In async GRPO the importance weight pi_old / pi_generator of stale samples is
    then computed from the training forward's pi_old. Off when seq_logprob_error_threshold is set, with
    use_kl_in_reward, or with CISPO / REINFORCE losses, which need the logprobs before training."""
    invalid_tool_call_advantage: float | None = None
    """Message-level advantage penalty (synchronous GRPO): assistant messages flagged `is_invalid_tool_call` get this
    advantage. The reference's key; the same setting as reward_penalties.invalid_tool_call_advantage (set one)."""
    malformed_thinking_advantage: float | None = None
    """As invalid_tool_call_advantage, for messages flagged `has_malformed_thinking`."""
    async_grpo: AsyncGRPOConfig = AsyncGRPOConfig()
    """Asynchronous GRPO (off by default): see `AsyncGRPOConfig`."""


class RewardPenaltiesConfig(Strict):
    """Message-level advantage penalties: an assistant message flagged by the environment gets this advantage.
    Only the legacy GRPO trainer (data_plane.enabled=false) applies them; the data-plane trainer refuses them."""

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
    """PPO's advantage estimator. The scalar reward lands on each row's last trained token."""

    name: Literal["gae", "raw_reward"] = "gae"
    """`gae`: generalized advantage estimation over the critic's values. `raw_reward`: the reward itself as every
    token's advantage, with discounted Monte-Carlo returns (lambda 1) as the critic's targets."""
    gae_lambda: Annotated[float, Field(ge=0, le=1)] = 0.95
    """GAE lambda: 0 is one-step TD, 1 the Monte-Carlo return minus the value."""
    gae_gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Discount per token (also raw_reward's return discount); 1: no discounting."""
    normalize_advantages: bool = True
    """Whiten advantages (mean 0, std 1) over all valid tokens of the batch."""
    gae_lambda_value: Annotated[float, Field(ge=0, le=1)] | None = None
    """Decoupled lambda for the critic's returns (VAPO); None means gae_lambda."""
    gae_lambda_policy: Annotated[float, Field(ge=0, le=1)] | None = None
    """Decoupled lambda for the actor's advantages; None means gae_lambda."""
    length_adaptive_alpha: NonNegFloat | None = None
    """Per-row policy lambda 1 - 1/(alpha * length), length in trained tokens (VAPO); None or 0 disables it."""


class PPOConfig(RolloutConfig):
    """PPO: the shared rollout settings plus the actor-critic update schedule and GAE."""

    max_num_steps: PositiveInt = 200
    """Training steps of the run (PPO's own default); with ppo_epochs it sets the LR-decay horizons."""
    ppo_epochs: PositiveInt = 1
    """Policy and value updates per rollout batch (all reuse the same advantages and old logprobs)."""
    policy_training_start_step: NonNegInt = 0
    """Critic warm-up: train only the value model until this many steps have run."""
    adv_estimator: PPOAdvEstimatorConfig = PPOAdvEstimatorConfig()
    """How advantages and the critic's return targets are computed."""

"""PPO, legacy path: actor-critic training with GAE; every rollout tensor travels through the driver.

The step follows the reference's (NeMo RL's) order: repeat → generate → rewards (scaling/shaping, overlong filtering) →
dynamic sampling when on (GRPO's filter: groups without reward spread are dropped before the critic sees them) →
loss masks on every assistant message → values → prev/reference logprobs → logprob-error masking → advantages and
returns → `ppo_epochs` × (critic update, then actor update unless in critic warm-up) → validate → checkpoint (policy
and critic) → log `train/*` and `critic/*`. The loop, validation and step tail are every trainer's (`runner.py`,
`validation.py`); `ppo_sync.py` is the data-plane sibling, phase for phase.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from relayrl.algorithms.dynamic_sampling import dynamic_sampling, group_reward_spread
from relayrl.algorithms.gae import (
    GeneralizedAdvantageEstimator,
    RawRewardAdvantageEstimator,
    advantage_value_metrics,
    build_ppo_advantage_estimator,
    require_valid_tokens,
)
from relayrl.algorithms.interfaces import LossFunction
from relayrl.algorithms.logprob_error import compute_seq_logprob_error_metrics
from relayrl.algorithms.protocols import BatchLoader, Generation, Policy, Tokenizer, Value
from relayrl.algorithms.reward_functions import post_process_rewards
from relayrl.algorithms.runner import LoopParts, StepOutput, run_loop
from relayrl.algorithms.trainer_common import (
    KvScaleSync,
    PolicyAndCritic,
    driver_nbytes,
    first_assistant_lengths,
    guard_finite,
    guard_rewards,
    message_log_sample_rows,
    ppo_epochs,
    ppo_step_metrics,
    rollout_in_driver,
)
from relayrl.algorithms.validation import Envs, ValidationResult, validate, validation_runner
from relayrl.config import MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.rollouts import (
    add_token_loss_masks,
    batched_message_log_to_flat_message,
    support_keys,
    trim_to_last_loss_token,
    with_support,
)
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState
from relayrl.utils.logger import Logger
from relayrl.utils.timer import Timer

__all__ = ["PPOSteps", "build_ppo_train_data", "ppo_train"]


def ppo_train(
    policy: Policy,
    policy_generation: Generation,
    value: Value,
    dataloader: BatchLoader,
    val_dataloader: BatchLoader | None,
    tokenizer: Tokenizer,
    loss_fn: LossFunction,
    value_loss_fn: LossFunction,
    task_to_env: Envs,
    val_task_to_env: Envs | None,
    logger: Logger,
    checkpointer: CheckpointManager,
    save_state: GRPOSaveState,
    master_config: MasterConfig,
) -> dict[str, object]:
    """Run PPO until max_num_steps / max_num_epochs / early stop / wall-clock budget. Returns the last metrics."""
    cfg, timer = master_config, Timer()

    def validate_at(step: int) -> ValidationResult:
        return validate(policy_generation, val_dataloader, tokenizer, val_task_to_env, step, cfg, logger)

    steps = PPOSteps(
        policy,
        policy_generation,
        value,
        tokenizer,
        loss_fn,
        value_loss_fn,
        task_to_env,
        logger,
        cfg,
        timer,
        validate_at,
        KvScaleSync(policy, policy_generation, timer, tokenizer.pad_token_id, val_dataloader),
    )
    both = PolicyAndCritic(policy, value)
    return run_loop(steps, LoopParts(cfg, save_state, timer, dataloader, both, policy_generation, checkpointer, logger))


class PPOSteps:
    """The legacy PPO step: each phase a method under its timer; rollout tensors held by the driver."""

    def __init__(
        self,
        policy: Policy,
        policy_generation: Generation,
        value: Value,
        tokenizer: Tokenizer,
        loss_fn: LossFunction,
        value_loss_fn: LossFunction,
        task_to_env: Envs,
        logger: Logger,
        cfg: MasterConfig,
        timer: Timer,
        validate_at: Callable[[int], ValidationResult],
        kv_sync: KvScaleSync,
    ) -> None:
        self.policy, self.generation, self.value, self.tokenizer = policy, policy_generation, value, tokenizer
        self.kv_sync = kv_sync
        self.loss_fn, self.value_loss_fn, self.task_to_env = loss_fn, value_loss_fn, task_to_env
        self.logger, self.cfg, self.p, self.timer = logger, cfg, cfg.ppo, timer
        self.estimator: GeneralizedAdvantageEstimator | RawRewardAdvantageEstimator = build_ppo_advantage_estimator(
            cfg.ppo.adv_estimator, cfg.loss_fn
        )
        self.skip_ref = not cfg.reference_model_needed
        self.pad_id = tokenizer.pad_token_id
        self.validate = validation_runner(policy_generation, logger, validate_at, before=kv_sync.before_validation)
        # dynamic sampling collects groups across generation batches until a step's worth survives
        self.batch_cache: BatchedDataDict | None = None
        self.num_gen_batches = 0
        self.pending_rewards: list[torch.Tensor] = []  # every reward generated this step, for train/reward
        self.skipped = 0  # samples dropped this step for a non-finite reward (non_finite: skip)

    def close(self) -> None:
        """Nothing to release: the legacy trainer owns no actor."""

    def step(self, batch: BatchedDataDict, step: int) -> StepOutput | None:
        timer, p, policy, value = self.timer, self.p, self.policy, self.value
        self.num_gen_batches += 1
        with timer.time("data_processing"):  # repeat prompts G times; flattened prompts identify groups
            repeated = batch.repeat_interleave(p.num_generations_per_prompt)
            prompt_flat, _ = batched_message_log_to_flat_message(
                repeated["message_log"], pad_value_dict={"token_ids": self.pad_id}
            )
            prompt_ids = prompt_flat["token_ids"]  # [B, P]
        self.kv_sync.before_first_refit(repeated)
        repeated, rollout_metrics = self._generate(repeated)
        with timer.time("reward_calculation"):
            repeated["total_reward"], drop = guard_rewards(
                repeated["total_reward"], p.num_generations_per_prompt, self.cfg, step
            )
            if drop is not None:  # non_finite: skip
                repeated["loss_multiplier"] = repeated["loss_multiplier"].masked_fill(drop, 0)
                self.skipped += int(drop.sum())
            lengths = functools.partial(first_assistant_lengths, repeated["message_log"])
            rewards, unshaped = post_process_rewards(repeated["total_reward"], repeated["truncated"], lengths, p)  # [B]
        reward_for_log = rewards  # [B] every reward generated for the step
        ds_metrics: dict[str, float] = {}
        if p.use_dynamic_sampling:
            with timer.time("dynamic_sampling"):  # drop zero-std groups, accumulate survivors across generation batches
                kept = self._dynamic_sampling(repeated, prompt_ids, rewards, unshaped)
            if kept is None:
                return None
            repeated, reward_for_log, ds_metrics = kept
            prompt_ids, rewards = repeated["prompt_ids"], repeated["filtered_reward"]  # [B, P], [B]
        with timer.time("data_processing"):
            train_data, filter_metrics = build_ppo_train_data(repeated, rewards, self.pad_id, self.cfg)
        with timer.time("value_inference"):
            value.prepare_for_inference()
            train_data["values"] = value.get_values(train_data.select_keys(["input_ids", "input_lengths"]))["values"]
            value.finish_inference()
        self._logprobs(train_data)  # timed as prev_logprobs and reference
        with timer.time("prev_logprobs"):
            train_data["sample_mask"], seq_err_metrics = compute_seq_logprob_error_metrics(
                train_data["token_mask"],
                train_data["sample_mask"],
                train_data["prev_logprobs"],
                train_data["generation_logprobs"],
                rewards,
                p.seq_logprob_error_threshold,
            )
        with timer.time("advantage_calculation"):  # advantages and critic targets
            mask = train_data["token_mask"] * train_data["sample_mask"].unsqueeze(-1)  # [B, S]
            require_valid_tokens(mask)
            advantages, returns = self.estimator.compute_advantage(
                prompt_ids,
                rewards,
                mask,
                train_data["values"],
                logprobs_policy=train_data["prev_logprobs"],
                logprobs_reference=train_data["reference_policy_logprobs"],
            )
            train_data["advantages"] = advantages  # [B, S]
            train_data["returns"] = returns  # [B, S]
            guard_finite("advantages", advantages, step)
            guard_finite("returns", returns, step)
        train_policy, critic_metrics, metrics = ppo_epochs(
            timer,
            p,
            step,
            value,
            lambda: value.train(train_data, self.value_loss_fn),
            policy,
            lambda: policy.train(train_data, self.loss_fn),
        )
        self.kv_sync.after_training(lambda: train_data.select_keys(["input_ids", "input_lengths"]))
        with timer.time("logging"):  # the step's metrics and sample rows
            metrics.update(
                driver_bytes=float(driver_nbytes(train_data)),  # the legacy path moves every byte through the driver
                **ppo_step_metrics(
                    reward_for_log,
                    repeated["length"],
                    float(train_data["input_lengths"].sum()),
                    train_policy,
                    advantage_value_metrics(advantages, returns, train_data["values"], mask),
                    rollout_metrics,
                    seq_err_metrics,
                    filter_metrics,
                    ds_metrics,
                    repeated.get("filtered_reward"),
                ),
            )
            self.logger.log_metrics(critic_metrics, step, prefix="critic")
            samples = message_log_sample_rows(repeated["message_log"], rewards, step, self.cfg)
            if self.skipped:
                metrics["non_finite_samples_skipped"], self.skipped = float(self.skipped), 0
            self.num_gen_batches = 0
            return StepOutput(metrics, samples, {"critic": critic_metrics})

    def _dynamic_sampling(
        self, repeated: BatchedDataDict, prompt_ids: torch.Tensor, rewards: torch.Tensor, unshaped: torch.Tensor | None
    ) -> tuple[BatchedDataDict, torch.Tensor, dict[str, float]] | None:
        """GRPO's filter on this generation batch (groups judged on the unshaped rewards when shaping ran). Returns
        the step's rows (their `prompt_ids` and shaped `filtered_reward` with them), every reward generated for the
        step and the filter's metrics once enough rows survived, else None (the next loader batch is generated)."""
        repeated["prompt_ids"] = prompt_ids  # [B, P] the groups, kept with their rows
        repeated["total_reward"] = rewards  # [B] shaped: what the kept rows train on
        baseline, std = group_reward_spread(prompt_ids, rewards, unshaped)
        self.pending_rewards.append(rewards)
        train_batch, complete, self.batch_cache, ds_metrics = dynamic_sampling(
            repeated, std, baseline, self.num_gen_batches, self.cfg, self.batch_cache, {"prompt_ids": self.pad_id}
        )
        if not complete:
            return None
        reward_for_log = torch.cat(self.pending_rewards)
        self.batch_cache, self.pending_rewards = None, []
        return train_batch, reward_for_log, ds_metrics

    def _generate(self, repeated: BatchedDataDict) -> tuple[BatchedDataDict, dict[str, float]]:
        return rollout_in_driver(self.generation, self.timer, repeated, self.tokenizer, self.task_to_env, self.cfg)

    def _logprobs(self, train_data: BatchedDataDict) -> None:
        """Previous-policy and reference log-probs [B, S], timed as `prev_logprobs` and `reference`; a skipped
        reference reads as zeros."""
        with self.timer.time("prev_logprobs"):
            self.policy.prepare_for_lp_inference()
            lp_data = train_data.select_keys(
                ["input_ids", "input_lengths", "token_mask", "sample_mask", *support_keys(train_data)]
            )
            prev_lp = self.policy.get_logprobs(lp_data)["logprobs"]  # [B, S]
        with self.timer.time("reference"):
            ref_lp = torch.zeros_like(prev_lp)  # [B, S]
            if not self.skip_ref:
                ref_lp = self.policy.get_reference_policy_logprobs(lp_data)["reference_logprobs"]
        train_data["prev_logprobs"] = prev_lp
        train_data["reference_policy_logprobs"] = ref_lp


def build_ppo_train_data(
    batch: BatchedDataDict, rewards: torch.Tensor, pad_id: int, cfg: MasterConfig
) -> tuple[BatchedDataDict, dict[str, float]]:
    """Overlong filtering, loss masks on every assistant message, flattening: the tensors both models train on.
    Rows are cut after their last loss token (trailing tokens change no loss, value target or advantage).

    Returns {input_ids, input_lengths, generation_logprobs, rewards, token_mask, sample_mask} and filter metrics.
    """
    sample_mask = batch["loss_multiplier"].clone().float()  # [B]
    truncated = torch.as_tensor(batch["truncated"], dtype=torch.bool)  # [B]
    num_filtered = 0
    if cfg.ppo.overlong_filtering:
        num_filtered = int((truncated & (sample_mask > 0)).sum())
        sample_mask[truncated] = 0.0
    add_token_loss_masks(batch["message_log"], only_generated=False)
    flat, input_lengths = trim_to_last_loss_token(  # as GRPO and the rollout actor: same tensors on both paths
        *batched_message_log_to_flat_message(batch["message_log"], pad_value_dict={"token_ids": pad_id}),
        pad_value_dict={"token_ids": pad_id},
        make_sequence_length_divisible_by=cfg.policy.make_sequence_length_divisible_by,
    )
    train_data: BatchedDataDict = BatchedDataDict(
        input_ids=flat["token_ids"],  # [B, S]
        input_lengths=input_lengths,  # [B]
        generation_logprobs=flat["generation_logprobs"],  # [B, S]
        rewards=rewards.float(),  # [B]
        token_mask=flat["token_loss_mask"],  # [B, S]
        sample_mask=sample_mask,  # [B]
    )
    with_support(train_data, flat)
    return train_data, {"num_overlong_filtered": float(num_filtered)}

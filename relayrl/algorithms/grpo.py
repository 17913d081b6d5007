"""GRPO, legacy path: every rollout tensor travels through the driver in a BatchedDataDict.

The loop follows the reference step order (repeat → generate → rewards → baseline/std → dynamic sampling →
overlong filtering → prev/reference logprobs → logprob-error masking → advantages → train → validate →
checkpoint → log), each phase under a named timer. `grpo_sync.py` is its data-plane sibling, phase for phase.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from relayrl.algorithms.advantages import (
    advantage_metrics,
    apply_advantage_overrides,
    build_advantage_estimator,
    clip_advantages,
    message_level_advantages,
)
from relayrl.algorithms.dynamic_sampling import dynamic_sampling
from relayrl.algorithms.interfaces import LossFunction
from relayrl.algorithms.logprob_error import compute_seq_logprob_error_metrics
from relayrl.algorithms.protocols import BatchLoader, Generation, Policy, Tokenizer
from relayrl.algorithms.recording import TIMER as RECORD_TIMER
from relayrl.algorithms.recording import StepRecorder, record_legacy_step, recorded_fields
from relayrl.algorithms.reward_functions import post_process_rewards
from relayrl.algorithms.runner import LoopParts, StepOutput, run_loop
from relayrl.algorithms.trainer_common import (
    KvScaleSync,
    driver_nbytes,
    first_assistant_lengths,
    guard_finite,
    guard_rewards,
    guard_update,
    message_log_sample_rows,
    resolve_logprob_skip_flags,
    rollout_in_driver,
    step_metrics,
)
from relayrl.algorithms.utils import calculate_baseline_and_std_per_prompt
from relayrl.algorithms.validation import Envs, ValidationResult, validate, validation_runner
from relayrl.config import MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.rollouts import (
    add_token_loss_masks,
    batched_message_log_to_flat_message,
    build_message_advantage_overrides,
    support_keys,
    trim_to_last_loss_token,
    with_support,
)
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState
from relayrl.utils.logger import Logger
from relayrl.utils.timer import Timer

__all__ = ["GRPOSaveState", "GRPOSteps", "dynamic_sampling", "grpo_train", "validate"]


def grpo_train(
    policy: Policy,
    policy_generation: Generation,
    dataloader: BatchLoader,
    val_dataloader: BatchLoader | None,
    tokenizer: Tokenizer,
    loss_fn: LossFunction,
    task_to_env: Envs,
    val_task_to_env: Envs | None,
    logger: Logger,
    checkpointer: CheckpointManager,
    grpo_save_state: GRPOSaveState,
    master_config: MasterConfig,
) -> dict[str, object]:
    """Run GRPO until max_num_steps / max_num_epochs / early stop / wall-clock budget. Returns the last metrics."""
    timer = Timer()
    steps = GRPOSteps(
        policy,
        policy_generation,
        tokenizer,
        loss_fn,
        task_to_env,
        logger,
        master_config,
        timer,
        validate_at=lambda step: validate(
            policy_generation, val_dataloader, tokenizer, val_task_to_env, step, master_config, logger
        ),
        kv_sync=KvScaleSync(policy, policy_generation, timer, tokenizer.pad_token_id, val_dataloader),
    )
    parts = LoopParts(
        master_config, grpo_save_state, timer, dataloader, policy, policy_generation, checkpointer, logger
    )
    return run_loop(steps, parts)


class GRPOSteps:
    """The legacy GRPO step: each phase a method under its timer; rollout tensors held by the driver."""

    def __init__(
        self,
        policy: Policy,
        policy_generation: Generation,
        tokenizer: Tokenizer,
        loss_fn: LossFunction,
        task_to_env: Envs,
        logger: Logger,
        cfg: MasterConfig,
        timer: Timer,
        validate_at: Callable[[int], ValidationResult],
        kv_sync: KvScaleSync,
    ) -> None:
        self.policy, self.generation, self.tokenizer, self.loss_fn = policy, policy_generation, tokenizer, loss_fn
        self.kv_sync = kv_sync
        self.task_to_env, self.cfg, self.g, self.timer = task_to_env, cfg, cfg.grpo, timer
        self.estimator = build_advantage_estimator(cfg.grpo, cfg.loss_fn)
        self.skip_prev, self.skip_ref = resolve_logprob_skip_flags(cfg)
        self.pad_id = tokenizer.pad_token_id
        self.flag_to_adv = message_level_advantages(cfg)  # grpo.* or reward_penalties.* keys
        self.validate = validation_runner(policy_generation, logger, validate_at, before=kv_sync.before_validation)
        self.recorder = StepRecorder(cfg, logger.run_dir, "legacy")
        # dynamic sampling collects groups across generation batches until a step's worth survives
        self.batch_cache: BatchedDataDict | None = None
        self.num_gen_batches = 0
        self.pending_rewards: list[torch.Tensor] = []  # every reward generated this step, for train/reward
        self.skipped = 0  # samples dropped this step for a non-finite reward (non_finite: skip)

    def close(self) -> None:
        """Nothing to release: the legacy trainer owns no actor."""

    def step(self, batch: BatchedDataDict, step: int) -> StepOutput | None:
        timer, g = self.timer, self.g
        self.num_gen_batches += 1
        with timer.time("data_processing"):  # repeat prompts G times; flattened prompts identify groups
            repeated = batch.repeat_interleave(g.num_generations_per_prompt)
            prompt_flat, _ = batched_message_log_to_flat_message(
                repeated["message_log"], pad_value_dict={"token_ids": self.pad_id}
            )
            repeated["prompt_ids"] = prompt_flat["token_ids"]  # [B, P]
        self.kv_sync.before_first_refit(repeated)
        repeated, rollout_metrics = self._generate(repeated)
        repeated["env_reward"] = repeated["total_reward"]  # [B] before shaping: the flight recorder's reward_env
        with timer.time("reward_calculation"):
            self._guard_rewards(repeated, step)
            rewards, baseline, std = self._rewards(repeated)
        with timer.time("dynamic_sampling"):  # drop zero-std groups, accumulate survivors across generation batches
            self.pending_rewards.append(rewards)
            train_batch, is_complete, self.batch_cache, ds_metrics = dynamic_sampling(
                repeated, std, baseline, self.num_gen_batches, self.cfg, self.batch_cache, {"prompt_ids": self.pad_id}
            )
        if not is_complete:
            return None
        reward_for_log = torch.cat(self.pending_rewards)
        self.batch_cache, self.num_gen_batches, self.pending_rewards = None, 0, []
        rewards = train_batch.get("filtered_reward", train_batch["total_reward"])
        with timer.time("data_processing"):
            train_data, flat = self._train_data(train_batch)
        self._logprobs(train_data)  # timed as prev_logprobs and reference
        seq_err_metrics: dict[str, float] = {}
        if not self.skip_prev:  # sequence-level logprob-error metrics and optional masking
            with timer.time("prev_logprobs"):
                train_data["sample_mask"], seq_err_metrics = compute_seq_logprob_error_metrics(
                    train_data["token_mask"],
                    train_data["sample_mask"],
                    train_data["prev_logprobs"],
                    train_data["generation_logprobs"],
                    rewards,
                    g.seq_logprob_error_threshold,
                )
        with timer.time("advantage_calculation"):
            mask = train_data["token_mask"] * train_data["sample_mask"].unsqueeze(-1)  # [B, S]
            train_data["advantages"] = self._advantages(train_batch, train_data, flat, rewards, mask)  # [B, S]
            guard_finite("advantages", train_data["advantages"], step)
        with timer.time("policy_training"):
            self.policy.prepare_for_training()
            train_results = self.policy.train(train_data, self.loss_fn)
            guard_update(train_results, step)
            self.policy.finish_training()
        self.kv_sync.after_training(lambda: train_data.select_keys(["input_ids", "input_lengths"]))
        if self.recorder.due(step):
            with timer.time(RECORD_TIMER):
                fields = recorded_fields(self.skip_prev, self.skip_ref)
                record_legacy_step(
                    self.recorder,
                    step,
                    train_batch,
                    train_data,
                    fields,
                    rewards,
                    rollout_metrics,
                    g.num_generations_per_prompt,
                )
        with timer.time("logging"):  # the step's metrics and sample rows
            metrics = step_metrics(
                train_results=train_results,
                reward_for_log=reward_for_log,
                filtered_reward=train_batch.get("filtered_reward"),
                prompt_lengths=train_batch["length"],
                input_lengths=train_data["input_lengths"],
                adv_metrics=advantage_metrics(train_data["advantages"], mask, train_batch["baseline"]),
                rollout_metrics=rollout_metrics,
                seq_err_metrics=seq_err_metrics,
                ds_metrics=ds_metrics,
            )
            metrics["driver_bytes"] = float(driver_nbytes(train_data))  # the legacy path moves every byte through here
            if self.skipped:
                metrics["non_finite_samples_skipped"], self.skipped = float(self.skipped), 0
            return StepOutput(metrics, message_log_sample_rows(train_batch["message_log"], rewards, step, self.cfg))

    def _guard_rewards(self, repeated: BatchedDataDict, step: int) -> None:
        """Stop on a non-finite reward, or take its prompt's group out of the loss (`non_finite: skip`)."""
        repeated["total_reward"], drop = guard_rewards(
            repeated["total_reward"], self.g.num_generations_per_prompt, self.cfg, step
        )
        if drop is not None:
            repeated["loss_multiplier"] = repeated["loss_multiplier"].masked_fill(drop, 0)
            self.skipped += int(drop.sum())

    def _generate(self, repeated: BatchedDataDict) -> tuple[BatchedDataDict, dict[str, float]]:
        return rollout_in_driver(self.generation, self.timer, repeated, self.tokenizer, self.task_to_env, self.cfg)

    def _rewards(self, repeated: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scaling/shaping, then the per-prompt baseline and std. Returns (rewards, baseline, std), each [B]."""
        g = self.g
        rewards, unshaped = post_process_rewards(
            repeated["total_reward"],
            repeated["truncated"],
            functools.partial(first_assistant_lengths, repeated["message_log"]),
            g,
        )
        repeated["total_reward"] = rewards
        baseline, std = calculate_baseline_and_std_per_prompt(
            repeated["prompt_ids"],
            rewards,
            torch.ones_like(rewards),
            leave_one_out_baseline=g.use_leave_one_out_baseline,
            std_rewards=unshaped if (unshaped is not None and g.use_dynamic_sampling) else None,
        )
        return rewards, baseline, std

    def _train_data(self, train_batch: BatchedDataDict) -> tuple[BatchedDataDict, BatchedDataDict]:
        """Overlong filtering, loss masks, flattening: the tensors training reads. Returns (train_data, flat)."""
        loss_multiplier = train_batch["loss_multiplier"].clone().float()  # [B]
        if self.g.overlong_filtering:
            loss_multiplier[train_batch["truncated"].bool()] = 0.0
        add_token_loss_masks(train_batch["message_log"], only_generated=True)
        if self.flag_to_adv:
            build_message_advantage_overrides(train_batch["message_log"], self.flag_to_adv)
        flat, input_lengths = trim_to_last_loss_token(
            *batched_message_log_to_flat_message(train_batch["message_log"], pad_value_dict={"token_ids": self.pad_id}),
            pad_value_dict={"token_ids": self.pad_id},
            make_sequence_length_divisible_by=self.cfg.policy.make_sequence_length_divisible_by,
        )
        train_data: BatchedDataDict = BatchedDataDict(
            input_ids=flat["token_ids"],  # [B, S]
            input_lengths=input_lengths,  # [B]
            generation_logprobs=flat["generation_logprobs"],  # [B, S]
            token_mask=flat["token_loss_mask"],  # [B, S]
            sample_mask=loss_multiplier,  # [B]
        )
        with_support(train_data, flat)
        return train_data, flat

    def _logprobs(self, train_data: BatchedDataDict) -> None:
        """Previous-policy and reference log-probs [B, S], timed as `prev_logprobs` and `reference`; a skipped pass
        reads as zeros."""
        with self.timer.time("prev_logprobs"):
            if not (self.skip_prev and self.skip_ref):
                self.policy.prepare_for_lp_inference()
            lp_data = train_data.select_keys(
                ["input_ids", "input_lengths", "token_mask", "sample_mask", *support_keys(train_data)]
            )
            zeros = torch.zeros_like(train_data["generation_logprobs"])
            prev_lp = zeros if self.skip_prev else self.policy.get_logprobs(lp_data)["logprobs"]
        with self.timer.time("reference"):
            ref_lp = (
                zeros if self.skip_ref else self.policy.get_reference_policy_logprobs(lp_data)["reference_logprobs"]
            )
        train_data["prev_logprobs"] = prev_lp  # [B, S]
        train_data["reference_policy_logprobs"] = ref_lp  # [B, S]

    def _advantages(
        self,
        train_batch: BatchedDataDict,
        train_data: BatchedDataDict,
        flat: BatchedDataDict,
        rewards: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Advantages [B, S], then message-level penalties and clipping."""
        advantages = self.estimator.compute_advantage(
            train_batch["prompt_ids"],
            rewards,
            mask,
            logprobs_policy=train_data["prev_logprobs"],
            logprobs_reference=train_data["reference_policy_logprobs"],
        )
        if self.flag_to_adv:
            advantages = apply_advantage_overrides(advantages, flat["advantage_override"])
        return clip_advantages(advantages, self.g.advantage_clip_low, self.g.advantage_clip_high)

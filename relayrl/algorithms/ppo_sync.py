"""PPO, data-plane path: rollout tensors live in a sample-keyed store; the driver handles metadata and per-row scalars.

Sibling of `ppo.py`, phase for phase (same timers, same order, same helpers and metrics), so the two read side by
side and log identical numbers (`relayrl parity`). Only data movement differs:
- the rollout actor writes the bulk (`input_ids`, `generation_logprobs`, `token_mask`, `sample_mask`) once, under
  keys minted at rollout, and returns a small per-row carry (rewards, lengths, loss-token counts);
- the critic's workers write `values`, the policy's workers `prev_logprobs` / `reference_policy_logprobs`, all
  under the same keys; the driver writes only per-row columns (`rewards`, `sample_mask`);
- GAE runs on the critic's workers (`TQValue.compute_advantages_from_meta`), not on the driver. It needs the
  per-token values, masks and (with the KL in the reward) both logprob columns, all already in the store next to
  those workers; on the driver it would cost a read of those columns and a write of `advantages` and `returns`,
  about as many bytes as the rollout itself. The recursion is row-local; the optional whitening is the only
  batch-wide step and costs three float64 moments per shard (one pass, bit-exact, when there is a single shard).
  Only the `advantages/*`, `returns/mean`, `values/mean` metrics come back;
- `ppo_epochs` of critic and actor updates run from metadata; `finish_step` clears every key of the step and
  fails on any leftover key (nothing is filtered mid-step in PPO, so every minted key is trained on).
Each step logs `train/driver_bytes` (carry + every driver put/get) and `train/store_bytes_written`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from relayrl.algorithms.gae import build_ppo_advantage_estimator, require_valid_tokens
from relayrl.algorithms.grpo_common import StepTail, carry_sample_rows, early_stop_reached, post_process_rewards
from relayrl.algorithms.grpo_sync import (
    _compute_seq_logprob_error_metrics,
    rollout_carry_keys,
    sync_validation_runner,
)
from relayrl.algorithms.ppo import _PolicyAndCritic, rollout_view
from relayrl.algorithms.utils import mean_over_epochs, policy_train_metrics
from relayrl.config import MasterConfig
from relayrl.data_plane.schema import DP_TRAIN_FIELDS, PREV_LOGPROBS, REFERENCE_POLICY_LOGPROBS
from relayrl.experience.carry_wire import decode_carry, wire_nbytes
from relayrl.experience.ray_rollout import rollout_actor_cls
from relayrl.experience.sync_rollout_actor import SyncRolloutActor
from relayrl.utils.checkpoint import GRPOSaveState
from relayrl.utils.timer import TimeoutChecker, Timer

__all__ = ["ppo_train_sync"]

_CARRY = ["total_reward", "loss_multiplier", "truncated", "length", "loss_token_counts"]


def ppo_train_sync(
    policy: Any,
    policy_generation: Any,
    value: Any,
    dataloader: Any,
    val_dataloader: Any,
    tokenizer: Any,
    loss_fn: Any,
    value_loss_fn: Any,
    task_to_env: dict[str, Any],
    val_task_to_env: dict[str, Any] | None,
    logger: Any,
    checkpointer: Any,
    save_state: GRPOSaveState,
    master_config: MasterConfig,
) -> dict[str, Any]:
    """Run PPO through the data plane. Same signature, stopping rules and metrics as `ppo.ppo_train`."""
    cfg, p = master_config, master_config.ppo
    _check_components(cfg, policy, value)
    view = rollout_view(cfg)
    state = save_state
    timer = Timer()
    timeout = TimeoutChecker(cfg.checkpointing.checkpoint_must_save_by, fit_last_save_time=True)
    timeout.start_iterations()
    estimator = build_ppo_advantage_estimator(p.adv_estimator, cfg.loss_fn)
    skip_ref = not cfg.reference_model_needed
    train_fields = [f for f in DP_TRAIN_FIELDS if not (skip_ref and f == REFERENCE_POLICY_LOGPROBS)]
    kl_fields = _kl_logprob_fields(cfg, skip_ref)
    rollout_actor = rollout_actor_cls(cfg)(policy_generation, tokenizer, task_to_env, view, cfg.data_plane)
    carry_keys = rollout_carry_keys(_CARRY, p.reward_shaping.enabled, cfg.logger.num_train_samples_to_log)
    target = p.num_prompts_per_step * p.num_generations_per_prompt
    last_metrics: dict[str, Any] = {}
    run_validation = sync_validation_runner(
        rollout_actor, policy, policy_generation, val_dataloader, val_task_to_env, view, logger
    )

    both = _PolicyAndCritic(policy, value)
    tail = StepTail(
        cfg, state, timer, timeout, dataloader, both, policy_generation, checkpointer, logger, run_validation
    )
    if p.val_at_start and state.total_steps == 0:
        start_metrics = run_validation(0)
        if early_stop_reached(start_metrics, cfg):
            rollout_actor.shutdown()
            return {"validation": start_metrics}

    while state.current_epoch < p.max_num_epochs and state.total_steps < p.max_num_steps:
        for batch in dataloader:
            step = state.total_steps + 1
            timer.start("total_step_time")

            # ---- repeat prompts G times (the actor flattens and groups them) ----
            with timer.time("data_processing"):
                repeated = batch.repeat_interleave(p.num_generations_per_prompt)

            # ---- generate: one call rolls out, scores, flattens and writes the bulk to the store ----
            with timer.time("prepare_for_generation/total"):
                policy_generation.prepare_for_generation()
            with timer.time("generation"):
                _reset_byte_counters(policy, value, rollout_actor)  # validation traffic is not the step's
                value.prepare_step(target)  # the PPO schema: GRPO's fields plus values, returns, rewards
                meta, carry, rollout_metrics, _ = rollout_actor.rollout_to_tq(
                    repeated,
                    partition_id=value.tq_partition_id,
                    group_size=p.num_generations_per_prompt,
                    carry_keys=carry_keys,
                    wire=True,
                    text_rows=cfg.logger.num_train_samples_to_log,
                )
                carry_bytes = wire_nbytes(carry)  # what crossed to the driver: its smallest exact form
                carry = decode_carry(carry)  # per-row values, dtypes as the legacy trainer's
            with timer.time("reward_calculation"):
                lengths = functools.partial(carry.__getitem__, "response_token_lengths")
                rewards, _ = post_process_rewards(carry["total_reward"], carry["truncated"], lengths, cfg)  # [B]

            # ---- overlong filtering; the workers read the per-row sample mask and rewards from the store ----
            with timer.time("data_processing"):
                sample_mask = carry["loss_multiplier"].clone().float()  # [B]
                truncated = carry["truncated"].bool()  # [B]
                num_filtered = 0
                if p.overlong_filtering:
                    num_filtered = int((truncated & (sample_mask > 0)).sum())
                    sample_mask[truncated] = 0.0
                filter_metrics = {"num_overlong_filtered": float(num_filtered)}
                columns = {"rewards": rewards.float()}  # [B]
                if not torch.equal(sample_mask, carry["loss_multiplier"]):
                    columns["sample_mask"] = sample_mask  # [B]
                value.write_to_dataplane(meta, columns)

            # ---- critic values, prev and reference logprobs: computed and written back by the workers ----
            with timer.time("value_inference"):
                value.prepare_for_inference()
                value.get_values_from_meta(meta, timer=timer)
                value.finish_inference()
            with timer.time("policy_and_reference_logprobs"):
                policy.prepare_for_lp_inference()
                policy.get_logprobs_from_meta(meta, timer=timer)
                if not skip_ref:
                    policy.get_reference_policy_logprobs_from_meta(meta, timer=timer)
            new_mask, seq_err_metrics = _compute_seq_logprob_error_metrics(
                policy=policy,
                meta=meta,
                sample_mask=sample_mask,
                rewards=rewards,
                seq_logprob_error_threshold=p.seq_logprob_error_threshold,
            )

            # ---- advantages and critic targets: GAE on the critic's workers, written back as columns ----
            with timer.time("advantage_calculation"):
                require_valid_tokens(carry["loss_token_counts"] * (new_mask != 0))  # [B] loss tokens per row
                if not torch.equal(new_mask, sample_mask):
                    value.write_to_dataplane(meta, {"sample_mask": new_mask})
                sample_mask = new_mask
                adv_metrics = value.compute_advantages_from_meta(meta, estimator, logprob_fields=kl_fields, timer=timer)

            # ---- ppo_epochs × (critic, actor) from metadata; the actor waits for the critic warm-up ----
            train_policy = state.total_steps >= p.policy_training_start_step
            critic_results, policy_results = [], []
            for _ in range(p.ppo_epochs):
                with timer.time("value_training"):
                    value.prepare_for_training()
                    critic_results.append(value.train_from_meta(meta, value_loss_fn, timer=timer))
                    value.finish_training()
                if train_policy:
                    with timer.time("policy_training"):
                        policy.prepare_for_training()
                        policy_results.append(
                            policy.train_from_meta(meta, loss_fn, timer=timer, train_fields=train_fields)
                        )
                        policy.finish_training()
            value.finish_step(meta)  # clears every key of the step; a leftover key is an error

            # ---- metrics, then validate / checkpoint / log (GRPO's step tail; the critic saved beside the policy) ----
            critic_metrics = mean_over_epochs([r["metrics"] for r in critic_results])
            metrics = mean_over_epochs([policy_train_metrics(r) for r in policy_results])
            metrics.setdefault("global_valid_toks", critic_metrics.get("global_valid_toks", 0.0))
            dp_metrics = _step_bytes(policy, value, rollout_actor, carry_bytes)
            metrics.update(
                driver_bytes=dp_metrics["data_plane/step/driver_bytes"],
                store_bytes_written=dp_metrics["data_plane/step/store_bytes_written"],
                driver_fraction_of_store_bytes=dp_metrics["data_plane/step/driver_fraction_of_store_bytes"],
                reward=float(rewards.float().mean()),
                mean_prompt_length=float(carry["length"].float().mean()),
                total_num_tokens=float(sum(meta.sequence_lengths or [])),
                policy_trained=float(train_policy),
                **adv_metrics,
                **rollout_metrics,
                **seq_err_metrics,
                **filter_metrics,
            )
            logger.log_metrics(dp_metrics, step)
            samples = carry_sample_rows(carry, rewards, step, cfg.logger.num_train_samples_to_log)
            logger.log_metrics(critic_metrics, step, prefix="critic")
            stop, last_metrics = tail.finish(step, metrics, samples)
            last_metrics["critic"] = critic_metrics
            if stop:
                rollout_actor.shutdown()
                return last_metrics
        state.current_epoch += 1
        state.current_step = 0
    rollout_actor.shutdown()
    return last_metrics


def _check_components(cfg: MasterConfig, policy: Any, value: Any) -> None:
    if cfg.algorithm != "ppo":
        raise ValueError(f"ppo_train_sync needs algorithm: ppo, got {cfg.algorithm!r}")
    if not cfg.data_plane.enabled:
        raise ValueError("ppo_train_sync needs data_plane.enabled=true; use ppo.ppo_train (the legacy trainer)")
    if not hasattr(policy, "dp_cfg") or not hasattr(value, "dp_cfg"):
        raise ValueError("ppo_train_sync needs a TQPolicy and a TQValue (both attached to the data plane)")
    if value.tq_partition_id != policy.tq_partition_id:
        raise ValueError(
            f"the policy and the critic must share one partition ({policy.tq_partition_id!r} vs "
            f"{value.tq_partition_id!r})"
        )


def _kl_logprob_fields(cfg: MasterConfig, skip_ref: bool) -> tuple[str, ...]:
    """The logprob columns GAE reads: both when the KL is in the reward (a skipped reference reads as zeros)."""
    if not (cfg.loss_fn.use_kl_in_reward and cfg.loss_fn.reference_policy_kl_penalty > 0):
        return ()
    return (PREV_LOGPROBS,) if skip_ref else (PREV_LOGPROBS, REFERENCE_POLICY_LOGPROBS)


def _reset_byte_counters(policy: Any, value: Any, rollout_actor: SyncRolloutActor) -> None:
    policy.data_plane_metrics(reset=True, extra=[rollout_actor.data_plane_metrics(reset=True)])
    value.data_plane_metrics(reset=True)


def _step_bytes(policy: Any, value: Any, rollout_actor: SyncRolloutActor, carry_bytes: int) -> dict[str, float]:
    """The policy's `data_plane/*` metrics over every client of the step (policy driver and workers, rollout actor,
    critic driver and workers) plus `data_plane/step/*`: bytes through the driver (carry + the two driver clients'
    puts and gets) and bytes written to the store by anyone."""
    critic = value.data_plane_metrics(reset=True)
    critic_workers = {
        "data_plane/put/bytes": critic.pop("data_plane/workers/put_bytes", 0.0),
        "data_plane/get/bytes": critic.pop("data_plane/workers/get_bytes", 0.0),
    }
    out = policy.data_plane_metrics(
        reset=True, extra=[rollout_actor.data_plane_metrics(reset=True), critic, critic_workers]
    )
    out["data_plane/driver_bytes"] = out.get("data_plane/driver_bytes", 0.0) + critic.get(
        "data_plane/driver_bytes", 0.0
    )
    driver = out["data_plane/driver_bytes"] + carry_bytes
    written = out.get("data_plane/all/put_bytes", 0.0)
    out["data_plane/driver_fraction_of_written"] = out["data_plane/driver_bytes"] / written if written else 0.0
    out["data_plane/step/driver_bytes"] = float(driver)
    out["data_plane/step/store_bytes_written"] = float(written)
    out["data_plane/step/driver_fraction_of_store_bytes"] = float(driver) / max(written, 1.0)
    return out

"""GRPO, data-plane path: rollout tensors live in a sample-keyed store; the driver handles metadata and per-row scalars.

Sibling of `grpo.py`, phase for phase (same timers, same order, same shared helpers), so the two read side by side
and log identical metrics. What differs is only where data lives:
- the rollout actor writes the bulk (`input_ids`, `generation_logprobs`, `token_mask`, `sample_mask`) once, under
  keys minted at rollout, and returns a small per-row carry (rewards, lengths, group ids);
- logprob and training dispatches hand each data-parallel worker a slice of the keys; workers fetch their rows and
  write per-token results (`prev_logprobs`, `reference_policy_logprobs`) back under the same keys;
- the driver writes per-row columns (`advantages`, `sample_mask`) and clears every key at the end of the step.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch

from relayrl.algorithms.advantages import GRPOAdvantageEstimator, build_advantage_estimator, clip_advantages
from relayrl.algorithms.grpo_common import (
    StepTail,
    carry_sample_rows,
    early_stop_reached,
    post_process_rewards,
    resolve_logprob_skip_flags,
    step_metrics,
)
from relayrl.algorithms.logprob_error import seq_logprob_error_metrics_from_rows
from relayrl.algorithms.utils import calculate_baseline_and_std_per_prompt
from relayrl.config import MasterConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.schema import DP_TRAIN_FIELDS
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.carry_wire import decode_carry, wire_nbytes
from relayrl.experience.ray_rollout import rollout_actor_cls  # SyncRolloutActor, or a Ray actor on Ray
from relayrl.experience.sync_rollout_actor import SyncRolloutActor
from relayrl.utils.checkpoint import GRPOSaveState
from relayrl.utils.timer import TimeoutChecker, Timer

__all__ = [
    "_apply_dynamic_sampling",
    "_compute_seq_logprob_error_metrics",
    "_raise_if_message_level_advantage_penalties_enabled",
    "grpo_train_sync",
    "validate_sync",
]

_CARRY = ["total_reward", "loss_multiplier", "truncated", "length", "prompt_group", "loss_token_counts"]


def grpo_train_sync(
    policy: Any,
    policy_generation: Any,
    wrapped_dataloader: Any,
    val_dataloader: Any,
    tokenizer: Any,
    loss_fn: Any,
    task_to_env: dict[str, Any],
    val_task_to_env: dict[str, Any] | None,
    logger: Any,
    checkpointer: Any,
    grpo_save_state: GRPOSaveState,
    master_config: MasterConfig,
) -> dict[str, Any]:
    """Run GRPO through the data plane. Same signature, stopping rules and metrics as `grpo.grpo_train`."""
    cfg, g = master_config, master_config.grpo
    if not cfg.data_plane.enabled:
        raise ValueError("grpo_train_sync needs data_plane.enabled=true; use grpo.grpo_train (the legacy trainer)")
    _raise_if_message_level_advantage_penalties_enabled(cfg)
    if not hasattr(policy, "dp_cfg"):
        raise ValueError("grpo_train_sync needs a TQPolicy (a policy attached to the data plane)")
    state, dataloader = grpo_save_state, wrapped_dataloader
    timer = Timer()
    timeout = TimeoutChecker(cfg.checkpointing.checkpoint_must_save_by, fit_last_save_time=True)
    timeout.start_iterations()
    estimator = build_advantage_estimator(g, cfg.loss_fn)
    skip_prev, skip_ref = resolve_logprob_skip_flags(cfg)
    train_fields = _train_fields_for_step(skip_prev, skip_ref)
    rollout_actor = rollout_actor_cls(cfg)(policy_generation, tokenizer, task_to_env, cfg, cfg.data_plane)
    carry_keys = rollout_carry_keys(_CARRY, g.reward_shaping.enabled, cfg.logger.num_train_samples_to_log)
    target = g.num_prompts_per_step * g.num_generations_per_prompt
    last_metrics: dict[str, Any] = {}
    run_validation = sync_validation_runner(
        rollout_actor, policy, policy_generation, val_dataloader, val_task_to_env, cfg, logger
    )

    tail = StepTail(
        cfg, state, timer, timeout, dataloader, policy, policy_generation, checkpointer, logger, run_validation
    )
    if g.val_at_start and state.total_steps == 0:
        val_metrics = run_validation(0)
        if early_stop_reached(val_metrics, cfg):
            return {"validation": val_metrics}

    pending_meta: KVBatchMeta | None = None
    pending_carry: BatchedDataDict | None = None
    pending_unfiltered_rewards: list[torch.Tensor] = []
    num_gen_batches, step_carry_bytes = 0, 0
    while state.current_epoch < g.max_num_epochs and state.total_steps < g.max_num_steps:
        for batch in dataloader:
            step = state.total_steps + 1
            timer.start("total_step_time")
            num_gen_batches += 1

            # ---- repeat prompts G times (the actor flattens prompts into group ids) ----
            with timer.time("data_processing"):
                repeated = batch.repeat_interleave(g.num_generations_per_prompt)

            # ---- generate: one call rolls out, scores, flattens and writes the bulk to the store ----
            with timer.time("prepare_for_generation/total"):
                policy_generation.prepare_for_generation()
            with timer.time("generation"):
                if pending_meta is None:
                    # a new training step: byte counters start here (validation traffic is not the step's)
                    policy.data_plane_metrics(reset=True, extra=[rollout_actor.data_plane_metrics(reset=True)])
                    policy.prepare_step(num_samples=target, group_size=g.num_generations_per_prompt)
                meta, carry, rollout_metrics, _ = rollout_actor.rollout_to_tq(
                    repeated,
                    partition_id=policy.tq_partition_id,
                    group_size=g.num_generations_per_prompt,
                    first_iter=num_gen_batches == 1,
                    carry_keys=carry_keys,
                    wire=True,
                    text_rows=cfg.logger.num_train_samples_to_log,
                )
                step_carry_bytes += wire_nbytes(carry)  # what crossed to the driver: its smallest exact form
                carry = decode_carry(carry)  # per-row values, dtypes as the legacy trainer's

            # ---- rewards: scaling/shaping, then per-prompt baseline and std (on the carry only) ----
            with timer.time("reward_calculation"):
                rewards, unshaped = post_process_rewards(
                    carry["total_reward"],
                    carry["truncated"],
                    functools.partial(carry.__getitem__, "response_token_lengths"),
                    cfg,
                )
                carry["total_reward"] = rewards
                baseline, std = calculate_baseline_and_std_per_prompt(
                    carry["prompt_group"].unsqueeze(-1),
                    rewards,
                    torch.ones_like(rewards),
                    leave_one_out_baseline=g.use_leave_one_out_baseline,
                    std_rewards=unshaped if (unshaped is not None and g.use_dynamic_sampling) else None,
                )
                carry["baseline"], carry["std"] = baseline, std
                meta.stamp_tags({"std": std.tolist(), "baseline": baseline.tolist()})

            # ---- dynamic sampling: filter on tags without fetching; dropped keys leave the store at once ----
            ds_metrics: dict[str, Any] = {}
            with timer.time("dynamic_sampling"):
                if g.use_dynamic_sampling:
                    pending_meta, pending_carry, pending_unfiltered_rewards, complete, ds_metrics, unfiltered = (
                        _apply_dynamic_sampling(
                            meta=meta,
                            driver_carry=carry,
                            pending_meta=pending_meta,
                            pending_carry=pending_carry,
                            pending_unfiltered_rewards=pending_unfiltered_rewards,
                            train_prompts_size=target,
                            num_gen_batches=num_gen_batches,
                            max_gen_batches=g.dynamic_sampling_max_gen_batches,
                            policy=policy,
                        )
                    )
                    if not complete:
                        timer.stop("total_step_time")
                        continue
                    assert pending_meta is not None and pending_carry is not None and unfiltered is not None
                    meta, carry, reward_for_log = pending_meta, pending_carry, unfiltered
                    pending_meta, pending_carry = None, None
                else:
                    reward_for_log = rewards
            rewards = carry.get("filtered_reward", carry["total_reward"])

            # ---- overlong filtering: only the per-row sample mask changes; the store gets it if it changed ----
            with timer.time("data_processing"):
                sample_mask = carry["loss_multiplier"].clone().float()  # [B]
                if g.overlong_filtering:
                    sample_mask[carry["truncated"].bool()] = 0.0
                stored_mask = carry["loss_multiplier"].float()  # [B] what the store's sample_mask holds
                if not torch.equal(sample_mask, stored_mask):
                    policy.write_to_dataplane(meta, {"sample_mask": sample_mask})
                    stored_mask = sample_mask.clone()

            # ---- prev and reference logprobs: computed and written back by the workers ----
            with timer.time("policy_and_reference_logprobs"):
                if not (skip_prev and skip_ref):
                    policy.prepare_for_lp_inference()
                if not skip_prev:
                    policy.get_logprobs_from_meta(meta, timer=timer)
                if not skip_ref:
                    policy.get_reference_policy_logprobs_from_meta(meta, timer=timer)

            # ---- sequence-level logprob-error metrics and optional masking (reduced per row on the workers) ----
            seq_err_metrics: dict[str, float] = {}
            if not skip_prev:
                sample_mask, seq_err_metrics = _compute_seq_logprob_error_metrics(
                    policy=policy,
                    meta=meta,
                    sample_mask=sample_mask,
                    rewards=rewards,
                    seq_logprob_error_threshold=g.seq_logprob_error_threshold,
                )

            # ---- advantages (+ clipping): per row for GRPO, so only [B] floats go back to the store ----
            with timer.time("advantage_calculation"):
                valid_counts = carry["loss_token_counts"].long() * (sample_mask != 0)  # [B] loss tokens per row
                prompt_group = carry["prompt_group"].unsqueeze(-1)  # [B, 1]
                if isinstance(estimator, GRPOAdvantageEstimator):
                    adv_rows = estimator.compute_advantage(prompt_group, rewards, sample_mask.unsqueeze(-1))[:, 0]
                    adv_rows = clip_advantages(adv_rows, g.advantage_clip_low, g.advantage_clip_high)  # [B]
                    advantages_column: torch.Tensor = adv_rows
                    width = int(meta.extra_info.get("global_forward_pad_seqlen") or max(meta.sequence_lengths or [0]))
                    adv_metrics = _row_advantage_metrics(adv_rows, valid_counts, carry["baseline"], width)
                else:  # per-token estimators need the token mask on the driver (and cost per-token bytes)
                    cols = policy.read_from_dataplane(meta, select_fields=_token_fields(skip_prev, skip_ref))
                    mask = cols["token_mask"] * sample_mask.unsqueeze(-1)  # [B, S]
                    advantages_column = estimator.compute_advantage(
                        prompt_group, rewards, mask, cols.get("prev_logprobs"), cols.get("reference_policy_logprobs")
                    )
                    advantages_column = clip_advantages(advantages_column, g.advantage_clip_low, g.advantage_clip_high)
                    from relayrl.algorithms.grpo_common import advantage_metrics

                    adv_metrics = advantage_metrics(advantages_column, mask, carry["baseline"])
                columns = {"advantages": advantages_column}
                if not torch.equal(sample_mask, stored_mask):  # else the store already holds it
                    columns["sample_mask"] = sample_mask
                policy.write_to_dataplane(meta, columns)

            # ---- train: every DP worker fetches its keys ----
            with timer.time("policy_training"):
                policy.prepare_for_training()
                train_results = policy.train_from_meta(meta, loss_fn, timer=timer, train_fields=train_fields)
                policy.finish_training()
            policy.finish_step(meta)  # clears every key of the step; a leftover key is an error

            # ---- metrics, then validate / checkpoint / log (shared with grpo.py) ----
            metrics = step_metrics(
                train_results=train_results,
                reward_for_log=reward_for_log,
                filtered_reward=carry.get("filtered_reward"),
                prompt_lengths=carry["length"],
                input_lengths=torch.tensor(meta.sequence_lengths or [], dtype=torch.long),
                adv_metrics=adv_metrics,
                rollout_metrics=rollout_metrics,
                seq_err_metrics=seq_err_metrics,
                ds_metrics=ds_metrics,
            )
            dp_metrics = policy.data_plane_metrics(reset=True, extra=[rollout_actor.data_plane_metrics(reset=True)])
            metrics["driver_bytes"] = float(dp_metrics.get("data_plane/driver_bytes", 0.0) + step_carry_bytes)
            metrics["store_bytes_written"] = float(dp_metrics.get("data_plane/all/put_bytes", 0.0))
            metrics["driver_fraction_of_store_bytes"] = metrics["driver_bytes"] / max(
                metrics["store_bytes_written"], 1.0
            )
            # the handle itself (keys, lengths, tags) is control-plane metadata, reported apart from the payload
            metrics["driver_meta_bytes"] = float(len(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)))
            logger.log_metrics(dp_metrics, step)
            samples = carry_sample_rows(carry, rewards, step, cfg.logger.num_train_samples_to_log)
            stop, last_metrics = tail.finish(step, metrics, samples)
            num_gen_batches, pending_unfiltered_rewards, step_carry_bytes = 0, [], 0
            if stop:
                rollout_actor.shutdown()
                return last_metrics
        state.current_epoch += 1
        state.current_step = 0
    rollout_actor.shutdown()
    return last_metrics


def _raise_if_message_level_advantage_penalties_enabled(master_config: MasterConfig) -> None:
    """Message-level advantage penalties need per-message token spans, which only the legacy trainer has."""
    keys = master_config.reward_penalties.enabled_keys()
    if keys:
        names = ", ".join(f"reward_penalties.{k}" for k in keys)
        raise NotImplementedError(
            f"message-level advantage penalties ({names}) are not supported with data_plane.enabled=true; "
            "disable them or use the legacy trainer (data_plane.enabled=false)"
        )


def _train_fields_for_step(skip_prev_logprobs: bool, skip_reference_logprobs: bool = False) -> list[str]:
    """DP_TRAIN_FIELDS minus the logprob columns this step skipped (workers zero-fill them, as the legacy path)."""
    skipped = {"prev_logprobs"} if skip_prev_logprobs else set()
    if skip_reference_logprobs:
        skipped.add("reference_policy_logprobs")
    return [f for f in DP_TRAIN_FIELDS if f not in skipped]


def _token_fields(skip_prev: bool, skip_ref: bool) -> list[str]:
    return (
        ["token_mask"] + ([] if skip_prev else ["prev_logprobs"]) + ([] if skip_ref else ["reference_policy_logprobs"])
    )


def _apply_dynamic_sampling(
    *,
    meta: KVBatchMeta,
    driver_carry: BatchedDataDict,
    pending_meta: KVBatchMeta | None,
    pending_carry: BatchedDataDict | None,
    pending_unfiltered_rewards: list[torch.Tensor],
    train_prompts_size: int,
    num_gen_batches: int,
    max_gen_batches: int,
    policy: Any,
) -> tuple[KVBatchMeta | None, BatchedDataDict | None, list[torch.Tensor], bool, dict[str, Any], torch.Tensor | None]:
    """One dynamic-sampling iteration on metadata: drop zero-std rows (and their keys from the store), merge the
    survivors into the pending cache, report whether it reached `train_prompts_size` rows.

    Returns (pending_meta, pending_carry, pending_unfiltered_rewards, is_complete, ds_metrics, unfiltered_for_log);
    when complete, the pending meta/carry *are* the training batch and `unfiltered_for_log` holds every reward
    generated for this step (what train/reward reports, as in the legacy trainer).
    """
    pending_unfiltered_rewards.append(driver_carry["total_reward"])
    if meta.tags is None:
        raise ValueError("dynamic sampling needs meta.tags with a 'std' per row (stamp_tags before filtering)")
    keep = [i for i, t in enumerate(meta.tags) if float(t["std"]) != 0.0]
    drop = [meta.keys[i] for i, t in enumerate(meta.tags) if float(t["std"]) == 0.0]
    if drop:
        policy.discard_samples(drop, meta.partition_id)
    if keep:
        surv_meta = meta.subset(keep)
        surv_carry = driver_carry.select_indices(keep)
        surv_carry["filtered_reward"] = surv_carry["total_reward"]
        if pending_meta is None or pending_carry is None:
            pending_meta, pending_carry = surv_meta, surv_carry
        else:
            pending_meta = pending_meta.concat(surv_meta)
            pending_carry = BatchedDataDict.from_batches([pending_carry, surv_carry])
    have = 0 if pending_meta is None else pending_meta.size
    metrics: dict[str, Any] = {"dynamic_sampling_num_gen_batches": num_gen_batches}
    if have < train_prompts_size:
        if num_gen_batches > max_gen_batches:
            if pending_meta is not None:
                policy.discard_samples(pending_meta.keys, pending_meta.partition_id)
            raise ValueError(
                f"dynamic sampling reached the maximum allowed number of generation batches "
                f"(grpo.dynamic_sampling_max_gen_batches={max_gen_batches}) with only {have}/{train_prompts_size} rows "
                "of non-zero reward std; raise the limit or check the reward"
            )
        return pending_meta, pending_carry, pending_unfiltered_rewards, False, metrics, None
    assert pending_meta is not None and pending_carry is not None
    metrics["dynamic_sampling_num_discarded_valid_samples"] = have - train_prompts_size
    if have > train_prompts_size:
        policy.discard_samples(pending_meta.keys[train_prompts_size:], pending_meta.partition_id)
        pending_meta = pending_meta.slice(0, train_prompts_size)
        pending_carry = pending_carry.slice(0, train_prompts_size)
    return pending_meta, pending_carry, [], True, metrics, torch.cat(pending_unfiltered_rewards)


def _compute_seq_logprob_error_metrics(
    *,
    policy: Any,
    meta: KVBatchMeta,
    sample_mask: torch.Tensor,
    rewards: torch.Tensor,
    seq_logprob_error_threshold: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Same metrics and threshold masking as the legacy trainer, from per-row errors reduced on the workers."""
    per_row = policy.seq_logprob_error_from_meta(meta)  # {seq_logprob_error [B], num_loss_tokens [B]}
    return seq_logprob_error_metrics_from_rows(
        per_row["seq_logprob_error"], per_row["num_loss_tokens"], sample_mask, rewards, seq_logprob_error_threshold
    )


def _row_advantage_metrics(
    adv_rows: torch.Tensor, valid_counts: torch.Tensor, baseline: torch.Tensor, width: int
) -> dict[str, float]:
    """train/advantages/* and baseline_reward/* from per-row advantages, equal to the legacy per-token statistics:
    the loss-token values are each row's advantage repeated over its loss tokens, in row order."""
    from relayrl.algorithms.grpo_common import advantage_metrics

    valid = adv_rows.repeat_interleave(valid_counts)  # == advantages[mask.bool()] of the broadcast [B, S] tensor
    full = adv_rows.unsqueeze(-1).expand(-1, width)  # [B, S] broadcast, as the legacy estimator returns it
    return advantage_metrics(full, torch.zeros(0), baseline, valid_values=valid)


def rollout_carry_keys(base: list[str], reward_shaping: bool, num_samples_to_log: int) -> list[str]:
    """The per-row values a data-plane trainer takes back from the rollout actor (shaping and sample logging add
    their own)."""
    return (
        base + (["response_token_lengths"] if reward_shaping else []) + (["sample_text"] if num_samples_to_log else [])
    )


def sync_validation_runner(
    rollout_actor: SyncRolloutActor,
    policy: Any,
    policy_generation: Any,
    val_dataloader: Any,
    val_task_to_env: dict[str, Any] | None,
    master_config: MasterConfig,
    logger: Any,
) -> Callable[[int], dict[str, Any]]:
    """`run_validation(step)` of a data-plane trainer: `validate_sync` with generation prepared around the whole
    validation, its metrics logged under `validation/`."""

    def run_validation(step: int) -> dict[str, Any]:
        policy_generation.prepare_for_generation()
        val_metrics = validate_sync(
            rollout_actor=rollout_actor,
            policy=policy,
            val_dataloader=val_dataloader,
            val_task_to_env=val_task_to_env,
            step=step,
            master_config=master_config,
            logger=logger,
        )
        policy_generation.finish_generation()
        if val_metrics:
            logger.log_metrics(val_metrics, step, prefix="validation")
        return val_metrics

    return run_validation


def validate_sync(
    *,
    rollout_actor: SyncRolloutActor,
    policy: Any,
    val_dataloader: Any,
    val_task_to_env: dict[str, Any] | None,
    step: int,
    master_config: MasterConfig,
    logger: Any = None,
    partition_id: str = "val",
) -> dict[str, Any]:
    """Validation through the data plane: per batch, a `val` partition, one rollout_to_tq, then clear.

    The caller prepares and finishes generation around the whole validation, so inference state stays warm across
    batches. Accuracy, pass@k and average length match the legacy `validate`.
    """
    if val_dataloader is None or val_task_to_env is None:
        return {}
    g = master_config.grpo
    k = g.val_num_generations_per_prompt
    t0 = time.perf_counter()
    all_rewards, lengths, samples, seen = [], [], [], 0
    for batch in val_dataloader:
        if seen >= g.max_val_samples:
            break
        batch = batch.slice(0, min(batch.size, g.max_val_samples - seen))
        seen += batch.size
        repeated = batch.repeat_interleave(k)
        policy.prepare_val_partition(repeated.size, partition_id=partition_id)
        meta, carry, metrics, _ = rollout_actor.rollout_to_tq(
            repeated,
            partition_id=partition_id,
            group_size=k,
            first_iter=False,
            finish_generation=False,
            task_to_env_override=val_task_to_env,
            carry_keys=["total_reward", "message_log"],
            greedy=g.val_greedy,
        )
        policy.finish_step(meta)
        all_rewards.append(carry["total_reward"].float())
        lengths.append(metrics["mean_gen_tokens_per_sample"])
        for log, r in zip(carry["message_log"], carry["total_reward"].tolist()):
            samples.append({"content": log, "rewards": r})
    rewards = torch.cat(all_rewards) if all_rewards else torch.zeros(0)
    val_metrics: dict[str, Any] = {
        "accuracy": rewards.mean().item() if rewards.numel() else 0.0,
        "avg_length": sum(lengths) / max(len(lengths), 1),
        "num_samples": int(rewards.numel()),
    }
    if k > 1:
        val_metrics["pass_k"] = (rewards.view(-1, k) > 0).any(dim=1).float().mean().item()
    if logger is not None:
        logger.log_jsonl(samples, f"val_data_step{step}.jsonl")
        logger.log_metrics({"total_validation_time": time.perf_counter() - t0}, step, prefix="timing/validation")
    return val_metrics

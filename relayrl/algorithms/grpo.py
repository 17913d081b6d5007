"""GRPO, legacy path: every rollout tensor travels through the driver in a BatchedDataDict.

The loop follows the reference step order (repeat → generate → rewards → baseline/std → dynamic sampling →
overlong filtering → prev/reference logprobs → logprob-error masking → advantages → train → validate →
checkpoint → log), each phase under a named timer. `grpo_sync.py` is its data-plane sibling, phase for phase.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from relayrl.algorithms.advantages import apply_advantage_overrides, build_advantage_estimator, clip_advantages
from relayrl.algorithms.grpo_common import (
    StepTail,
    advantage_metrics,
    early_stop_reached,
    first_assistant_lengths,
    post_process_rewards,
    resolve_logprob_skip_flags,
    sample_rows,
    step_metrics,
)
from relayrl.algorithms.logprob_error import compute_seq_logprob_error_metrics
from relayrl.algorithms.utils import calculate_baseline_and_std_per_prompt
from relayrl.config import MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.rollouts import (
    add_token_loss_masks,
    batched_message_log_to_flat_message,
    build_message_advantage_overrides,
    run_multi_turn_rollout,
    trim_to_last_loss_token,
)
from relayrl.utils.checkpoint import GRPOSaveState
from relayrl.utils.timer import TimeoutChecker, Timer

__all__ = ["GRPOSaveState", "dynamic_sampling", "grpo_train", "validate"]


def grpo_train(
    policy: Any,
    policy_generation: Any,
    dataloader: Any,
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
    """Run GRPO until max_num_steps / max_num_epochs / early stop / wall-clock budget. Returns the last metrics."""
    cfg, g = master_config, master_config.grpo
    state = grpo_save_state
    timer = Timer()
    timeout = TimeoutChecker(cfg.checkpointing.checkpoint_must_save_by, fit_last_save_time=True)
    timeout.start_iterations()
    estimator = build_advantage_estimator(g, cfg.loss_fn)
    skip_prev, skip_ref = resolve_logprob_skip_flags(cfg)
    pad_id = tokenizer.pad_token_id
    flag_to_adv = cfg.reward_penalties.flag_to_advantage()
    last_metrics: dict[str, Any] = {}

    def run_validation(step: int) -> dict[str, Any]:
        return _run_validation(policy_generation, val_dataloader, tokenizer, val_task_to_env, step, cfg, logger)

    tail = StepTail(
        cfg, state, timer, timeout, dataloader, policy, policy_generation, checkpointer, logger, run_validation
    )
    if g.val_at_start and state.total_steps == 0:
        val_metrics = run_validation(0)
        if early_stop_reached(val_metrics, cfg):
            return {"validation": val_metrics}

    batch_cache: BatchedDataDict | None = None
    num_gen_batches = 0
    pending_unfiltered_rewards: list[torch.Tensor] = []  # every reward generated this step, for train/reward
    while state.current_epoch < g.max_num_epochs and state.total_steps < g.max_num_steps:
        for batch in dataloader:
            step = state.total_steps + 1
            timer.start("total_step_time")
            num_gen_batches += 1

            # ---- repeat prompts G times; flatten prompts (they identify groups) ----
            with timer.time("data_processing"):
                repeated = batch.repeat_interleave(g.num_generations_per_prompt)
                prompt_flat, _ = batched_message_log_to_flat_message(
                    repeated["message_log"], pad_value_dict={"token_ids": pad_id}
                )
                repeated["prompt_ids"] = prompt_flat["token_ids"]  # [B, P]

            # ---- generate (the engine reads the current weights; it refuses stale ones) ----
            with timer.time("prepare_for_generation/total"):
                policy_generation.prepare_for_generation()
            with timer.time("generation"):
                repeated, rollout_metrics = run_multi_turn_rollout(
                    policy_generation,
                    repeated,
                    tokenizer,
                    task_to_env,
                    max_seq_len=cfg.policy.max_total_sequence_length,
                    max_rollout_turns=g.max_rollout_turns,
                    greedy=False,
                )
                policy_generation.finish_generation()

            # ---- rewards: scaling/shaping, then per-prompt baseline and std ----
            with timer.time("reward_calculation"):
                rewards, unshaped = post_process_rewards(
                    repeated["total_reward"],
                    repeated["truncated"],
                    functools.partial(first_assistant_lengths, repeated["message_log"]),
                    cfg,
                )
                repeated["total_reward"] = rewards
                baseline, std = calculate_baseline_and_std_per_prompt(
                    repeated["prompt_ids"],
                    rewards,
                    torch.ones_like(rewards),
                    leave_one_out_baseline=g.use_leave_one_out_baseline,
                    std_rewards=unshaped if (unshaped is not None and g.use_dynamic_sampling) else None,
                )

            # ---- dynamic sampling: drop zero-std groups, accumulate survivors across generation batches ----
            with timer.time("dynamic_sampling"):
                pending_unfiltered_rewards.append(rewards)
                train_batch, is_complete, batch_cache, ds_metrics = dynamic_sampling(
                    repeated, std, baseline, num_gen_batches, cfg, batch_cache, {"prompt_ids": pad_id}
                )
            if not is_complete:
                timer.stop("total_step_time")
                continue
            reward_for_log = torch.cat(pending_unfiltered_rewards)
            rewards = train_batch.get("filtered_reward", train_batch["total_reward"])

            # ---- overlong filtering, loss masks, flatten to training tensors ----
            with timer.time("data_processing"):
                loss_multiplier = train_batch["loss_multiplier"].clone().float()
                if g.overlong_filtering:
                    loss_multiplier[train_batch["truncated"].bool()] = 0.0
                add_token_loss_masks(train_batch["message_log"], only_generated=True)
                if flag_to_adv:
                    build_message_advantage_overrides(train_batch["message_log"], flag_to_adv)
                flat, input_lengths = trim_to_last_loss_token(
                    *batched_message_log_to_flat_message(
                        train_batch["message_log"], pad_value_dict={"token_ids": pad_id}
                    ),
                    pad_value_dict={"token_ids": pad_id},
                    make_sequence_length_divisible_by=cfg.policy.make_sequence_length_divisible_by,
                )
                train_data: BatchedDataDict[Any] = BatchedDataDict(
                    input_ids=flat["token_ids"],  # [B, S]
                    input_lengths=input_lengths,  # [B]
                    generation_logprobs=flat["generation_logprobs"],  # [B, S]
                    token_mask=flat["token_loss_mask"],  # [B, S]
                    sample_mask=loss_multiplier,  # [B]
                )

            # ---- prev and reference logprobs ----
            with timer.time("policy_and_reference_logprobs"):
                if not (skip_prev and skip_ref):
                    policy.prepare_for_lp_inference()
                lp_data = train_data.select_keys(["input_ids", "input_lengths", "token_mask", "sample_mask"])
                zeros = torch.zeros_like(train_data["generation_logprobs"])
                prev_lp = zeros if skip_prev else policy.get_logprobs(lp_data)["logprobs"]
                ref_lp = zeros if skip_ref else policy.get_reference_policy_logprobs(lp_data)["reference_logprobs"]
                train_data["prev_logprobs"] = prev_lp  # [B, S]
                train_data["reference_policy_logprobs"] = ref_lp  # [B, S]

            # ---- sequence-level logprob-error metrics and optional masking ----
            seq_err_metrics: dict[str, float] = {}
            if not skip_prev:
                train_data["sample_mask"], seq_err_metrics = compute_seq_logprob_error_metrics(
                    train_data["token_mask"],
                    train_data["sample_mask"],
                    prev_lp,
                    train_data["generation_logprobs"],
                    rewards,
                    g.seq_logprob_error_threshold,
                )

            # ---- advantages (+ message-level penalties, clipping) ----
            with timer.time("advantage_calculation"):
                mask = train_data["token_mask"] * train_data["sample_mask"].unsqueeze(-1)  # [B, S]
                advantages = estimator.compute_advantage(
                    train_batch["prompt_ids"], rewards, mask, logprobs_policy=prev_lp, logprobs_reference=ref_lp
                )
                if flag_to_adv:
                    advantages = apply_advantage_overrides(advantages, flat["advantage_override"])
                advantages = clip_advantages(advantages, g.advantage_clip_low, g.advantage_clip_high)
                train_data["advantages"] = advantages  # [B, S]

            # ---- train ----
            with timer.time("policy_training"):
                policy.prepare_for_training()
                train_results = policy.train(train_data, loss_fn)
                policy.finish_training()

            # ---- metrics, then validate / checkpoint / log (shared with grpo_sync) ----
            metrics = step_metrics(
                train_results=train_results,
                reward_for_log=reward_for_log,
                filtered_reward=train_batch.get("filtered_reward"),
                prompt_lengths=train_batch["length"],
                input_lengths=input_lengths,
                adv_metrics=advantage_metrics(advantages, mask, train_batch["baseline"]),
                rollout_metrics=rollout_metrics,
                seq_err_metrics=seq_err_metrics,
                ds_metrics=ds_metrics,
            )
            metrics["driver_bytes"] = float(_nbytes(train_data))  # the legacy path moves every byte through here
            logs = train_batch["message_log"]
            samples = sample_rows(
                ["".join(m["content"] for m in log if m["role"] in ("system", "user")) for log in logs],
                ["".join(m["content"] for m in log if m["role"] == "assistant") for log in logs],
                rewards,
                step,
                cfg.logger.num_train_samples_to_log,
            )
            stop, last_metrics = tail.finish(step, metrics, samples)
            batch_cache, num_gen_batches, pending_unfiltered_rewards = None, 0, []
            if stop:
                return last_metrics
        state.current_epoch += 1
        state.current_step = 0
    return last_metrics


def dynamic_sampling(
    repeated_batch: BatchedDataDict,
    std: torch.Tensor,
    baseline: torch.Tensor,
    num_gen_batches: int,
    cfg: MasterConfig,
    batch_cache: BatchedDataDict | None = None,
    pad_value_dict: dict[str, int] | None = None,
) -> tuple[BatchedDataDict, bool, BatchedDataDict | None, dict[str, Any]]:
    """DAPO dynamic sampling on a BatchedDataDict. Returns (batch, is_complete, cache, metrics).

    Rows whose group has zero reward std carry no learning signal and are dropped; survivors accumulate across
    generation batches until `num_prompts_per_step × G` rows exist (extra rows are discarded and counted).
    Raises once more than `dynamic_sampling_max_gen_batches` generation batches failed to reach the target.
    """
    g = cfg.grpo
    repeated_batch["baseline"] = baseline  # [B]
    repeated_batch["std"] = std  # [B]
    if not g.use_dynamic_sampling:
        return repeated_batch, True, batch_cache, {}
    target = g.num_prompts_per_step * g.num_generations_per_prompt
    kept = torch.nonzero(std != 0).flatten()
    if kept.numel():
        filtered = repeated_batch.select_indices(kept)
        filtered["filtered_reward"] = filtered["total_reward"]
        batch_cache = (
            filtered if batch_cache is None else BatchedDataDict.from_batches([batch_cache, filtered], pad_value_dict)
        )
    metrics: dict[str, Any] = {"dynamic_sampling_num_gen_batches": num_gen_batches}
    have = 0 if batch_cache is None else batch_cache.size
    if have < target:
        if num_gen_batches > g.dynamic_sampling_max_gen_batches:
            raise ValueError(
                f"dynamic sampling reached the maximum allowed number of generation batches "
                f"(grpo.dynamic_sampling_max_gen_batches={g.dynamic_sampling_max_gen_batches}) with only "
                f"{have}/{target} rows of non-zero reward std; raise the limit or check the reward"
            )
        return repeated_batch, False, batch_cache, metrics
    assert batch_cache is not None
    metrics["dynamic_sampling_num_discarded_valid_samples"] = have - target
    return batch_cache.slice(0, target), True, None, metrics


def validate(
    policy_generation: Any,
    val_dataloader: Any,
    tokenizer: Any,
    val_task_to_env: dict[str, Any] | None,
    step: int,
    master_config: MasterConfig,
    logger: Any | None = None,
) -> dict[str, Any]:
    """Roll out the validation prompts (k generations each) and report accuracy, pass@k and length."""
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
        repeated, metrics = run_multi_turn_rollout(
            policy_generation,
            repeated,
            tokenizer,
            val_task_to_env,
            max_seq_len=master_config.policy.max_total_sequence_length,
            max_rollout_turns=g.max_rollout_turns,
            greedy=g.val_greedy,
        )
        all_rewards.append(repeated["total_reward"].float())
        lengths.append(metrics["mean_gen_tokens_per_sample"])
        for log, r in zip(repeated["message_log"], repeated["total_reward"].tolist()):
            samples.append({"content": [{"role": m["role"], "content": m["content"]} for m in log], "rewards": r})
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


def _run_validation(
    policy_generation: Any,
    val_dataloader: Any,
    tokenizer: Any,
    val_task_to_env: dict[str, Any] | None,
    step: int,
    cfg: MasterConfig,
    logger: Any,
) -> dict[str, Any]:
    policy_generation.prepare_for_generation()
    val_metrics = validate(policy_generation, val_dataloader, tokenizer, val_task_to_env, step, cfg, logger)
    policy_generation.finish_generation()
    if val_metrics:
        logger.log_metrics(val_metrics, step, prefix="validation")
    return val_metrics


def _nbytes(batch: BatchedDataDict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))

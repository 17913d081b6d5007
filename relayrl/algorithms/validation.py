"""Validation for every trainer: roll out the held-out prompts, report accuracy, pass@k and length.

The legacy trainers roll validation batches out in the driver (`validate`), the data-plane trainers through the
rollout actor into a per-batch `val` partition (`validate_sync`). Only that one call differs; the batching, the
metrics and the samples file are `_validate_batches`, so both paths report identical numbers. Both return
`(val_metrics, timing_metrics)`; `validation_runner` logs them under `validation/` and `timing/validation/`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from relayrl.algorithms.protocols import BatchLoader, DataPlanePolicy, Generation, RolloutActor, Tokenizer
from relayrl.config import MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface
from relayrl.experience.carry_wire import decode_carry
from relayrl.experience.rollouts import run_multi_turn_rollout
from relayrl.utils.logger import Logger

__all__ = ["ValidationResult", "pass_at_k", "sync_validator", "validate", "validate_sync", "validation_runner"]

Envs = dict[str, EnvironmentInterface]
#: One validation batch rolled out: (rewards [B], mean generated tokens per sample, samples for val_data_step*.jsonl)
BatchRollout = Callable[[BatchedDataDict], tuple[torch.Tensor, float, list[dict[str, object]]]]
#: What a validation returns: (val_metrics, timing_metrics), both empty when there is nothing to validate.
ValidationResult = tuple[dict[str, float], dict[str, float]]


def validate(
    policy_generation: Generation,
    val_dataloader: BatchLoader | None,
    tokenizer: Tokenizer,
    val_task_to_env: Envs | None,
    step: int,
    master_config: MasterConfig,
    logger: Logger | None = None,
) -> ValidationResult:
    """Roll out the validation prompts in the driver (k generations each). Returns (val_metrics: accuracy, pass@k,
    avg_length, num_samples; timing_metrics: total_validation_time)."""
    if val_dataloader is None or val_task_to_env is None:
        return {}, {}
    cfg = master_config

    def rollout(repeated: BatchedDataDict) -> tuple[torch.Tensor, float, list[dict[str, object]]]:
        repeated, metrics = run_multi_turn_rollout(
            policy_generation,
            repeated,
            tokenizer,
            val_task_to_env,
            max_seq_len=cfg.policy.max_total_sequence_length,
            max_rollout_turns=cfg.rollout.max_rollout_turns,
            greedy=cfg.rollout.val_greedy,
        )
        logs = [[{"role": m["role"], "content": m["content"]} for m in log] for log in repeated["message_log"]]
        return repeated["total_reward"], metrics["mean_gen_tokens_per_sample"], _samples(logs, repeated)

    return _validate_batches(val_dataloader, rollout, step, cfg, logger)


def validate_sync(
    *,
    rollout_actor: RolloutActor,
    policy: DataPlanePolicy,
    val_dataloader: BatchLoader | None,
    val_task_to_env: Envs | None,
    step: int,
    master_config: MasterConfig,
    logger: Logger | None = None,
    partition_id: str = "val",
) -> ValidationResult:
    """Validation through the data plane: per batch, a `val` partition, one rollout_to_tq, then clear.

    The caller prepares and finishes generation around the whole validation, so inference state stays warm across
    batches. Returns (val_metrics, timing_metrics) as the legacy `validate` does, with the same numbers.
    """
    if val_dataloader is None or val_task_to_env is None:
        return {}, {}
    k = master_config.rollout.val_num_generations_per_prompt

    def rollout(repeated: BatchedDataDict) -> tuple[torch.Tensor, float, list[dict[str, object]]]:
        policy.prepare_val_partition(repeated.size, partition_id=partition_id)
        meta, wire_carry, metrics = rollout_actor.rollout_to_tq(
            repeated,
            partition_id=partition_id,
            group_size=k,
            first_iter=False,
            finish_generation=False,
            task_to_env_override=val_task_to_env,
            carry_keys=["total_reward", "message_log"],
            greedy=master_config.rollout.val_greedy,
        )
        policy.finish_step(meta)
        carry = decode_carry(wire_carry)  # the per-row values, exactly as the actor made them
        return carry["total_reward"], metrics["mean_gen_tokens_per_sample"], _samples(carry["message_log"], carry)

    return _validate_batches(val_dataloader, rollout, step, master_config, logger)


def _samples(logs: list[Any], batch: BatchedDataDict) -> list[dict[str, object]]:
    return [{"content": log, "rewards": r} for log, r in zip(logs, batch["total_reward"].tolist())]


def _render(sample: dict[str, object]) -> str:
    """One line for the console: each message as `role: content`, then the reward."""
    content = sample["content"]
    if isinstance(content, list):
        content = " | ".join(f"{m.get('role')}: {m.get('content')}" if isinstance(m, dict) else str(m) for m in content)
    flat = " ".join(str(content).splitlines())
    return f"{flat} -> reward {sample['rewards']}"


def _validate_batches(
    val_dataloader: BatchLoader, rollout: BatchRollout, step: int, cfg: MasterConfig, logger: Logger | None
) -> ValidationResult:
    """Up to `max_val_samples` prompts, k generations each, through `rollout`; the metrics both paths report and
    the wall time it took. With a logger, the samples go to `val_data_step<step>.jsonl`."""
    r = cfg.rollout
    k = r.val_num_generations_per_prompt
    t0 = time.perf_counter()
    all_rewards: list[torch.Tensor] = []
    lengths: list[float] = []
    samples: list[dict[str, object]] = []
    seen = 0
    for batch in val_dataloader:
        if seen >= r.max_val_samples:
            break
        batch = batch.slice(0, min(batch.size, r.max_val_samples - seen))
        seen += batch.size
        rewards, mean_length, batch_samples = rollout(batch.repeat_interleave(k))
        all_rewards.append(rewards.float())  # [B * k]
        lengths.append(mean_length)
        samples.extend(batch_samples)
    rewards = torch.cat(all_rewards) if all_rewards else torch.zeros(0)
    val_metrics: dict[str, float] = {
        "accuracy": rewards.mean().item() if rewards.numel() else 0.0,
        "avg_length": sum(lengths) / max(len(lengths), 1),
        "num_samples": int(rewards.numel()),
    }
    if k > 1:
        val_metrics["pass_k"] = pass_at_k(rewards.view(-1, k) > 0, r.val_pass_k or k).float().mean().item()
    if logger is not None:
        logger.log_jsonl(samples, f"val_data_step{step}.jsonl")
        for i, sample in enumerate(samples[: cfg.logger.num_val_samples_to_print]):
            logger.print_message(f"validation step {step} sample {i + 1}/{len(samples)}: {_render(sample)}")
    return val_metrics, {"total_validation_time": time.perf_counter() - t0}


def pass_at_k(passed: torch.Tensor, k: int) -> torch.Tensor:
    """Unbiased pass@k per prompt (Chen et al. 2021) from `passed` [P, n] bool: 1 - C(n-c, k) / C(n, k), c = passes.

    Why not "any of k": with n > k rollouts that over-counts; this is the chance that k of the n, drawn without
    replacement, hold a pass. At k = n it is exactly "any of them passed" (0 or 1 per prompt). Returns [P] float64.
    """
    n = passed.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n = {n} rollouts per prompt, got k = {k}")
    fails = n - passed.sum(dim=1).to(torch.float64)  # [P]
    # C(n-c, k) / C(n, k) = prod_{i<k} (n-c-i) / (n-i); a factor is <= 0 once fewer than k rollouts failed
    factors = (fails.unsqueeze(1) - torch.arange(k, dtype=torch.float64)).clamp(min=0) / (
        n - torch.arange(k, dtype=torch.float64)
    )  # [P, k]
    return 1.0 - factors.prod(dim=1)


def sync_validator(
    rollout_actor: RolloutActor,
    policy: DataPlanePolicy,
    val_dataloader: BatchLoader | None,
    val_task_to_env: Envs | None,
    master_config: MasterConfig,
    logger: Logger,
) -> Callable[[int], ValidationResult]:
    """`validate_sync` bound to a data-plane trainer's actor, policy and data: validation at a given step."""

    def validate_at(step: int) -> ValidationResult:
        return validate_sync(
            rollout_actor=rollout_actor,
            policy=policy,
            val_dataloader=val_dataloader,
            val_task_to_env=val_task_to_env,
            step=step,
            master_config=master_config,
            logger=logger,
        )

    return validate_at


def validation_runner(
    policy_generation: Generation,
    logger: Logger,
    validate_at: Callable[[int], ValidationResult],
    before: Callable[[], None] | None = None,
) -> Callable[[int], dict[str, float]]:
    """`run_validation(step)` of a trainer: generation prepared around the whole validation, the timing logged under
    `timing/validation/` and the metrics under `validation/`. Returns the metrics. `before` runs ahead of the
    preparation (the FP8 KV-scale calibration that must precede a first refit)."""

    def run_validation(step: int) -> dict[str, float]:
        if before is not None:
            before()
        policy_generation.prepare_for_generation()
        val_metrics, timing_metrics = validate_at(step)
        if timing_metrics:
            logger.log_metrics(timing_metrics, step, prefix="timing/validation")
        policy_generation.finish_generation()
        if val_metrics:
            logger.log_metrics(val_metrics, step, prefix="validation")
        return val_metrics

    return run_validation

"""Dynamic sampling (DAPO): keep only prompt groups whose rewards differ, across generation batches.

One rule for every synchronous trainer, GRPO's and PPO's, legacy and data plane: a row is kept when the reward std of
its group is not 0 (a group whose rewards all agree carries no learning signal); survivors accumulate across
generation batches until a step's worth of rows (`num_prompts_per_step x num_generations_per_prompt`) exists, the
surplus is discarded and counted, and a step still short after more than `dynamic_sampling_max_gen_batches` batches
fails, naming that key. The legacy trainers filter their BatchedDataDict (`dynamic_sampling`); the data-plane
trainers filter on the per-row `std` tag of the handle without fetching a row (`apply_dynamic_sampling`): dropped
rows leave the store at once, survivors stay under their keys. Both keep rows in generation order, so the two
trainers train on the same rows.
"""

from __future__ import annotations

import torch

from relayrl.algorithms.protocols import DataPlanePolicy
from relayrl.algorithms.utils import calculate_baseline_and_std_per_prompt
from relayrl.config import MasterConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.distributed.batched_data_dict import BatchedDataDict

__all__ = ["apply_dynamic_sampling", "dynamic_sampling", "dynamic_sampling_on_meta", "group_reward_spread"]


def group_reward_spread(
    groups: torch.Tensor, rewards: torch.Tensor, unshaped: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's (baseline, std) per row [B] for dynamic sampling: over every row of the group (no leave-one-out, a key
    PPO lacks), on the rewards before shaping when shaping ran, as GRPO judges its groups. `groups` [B, P] rows
    equal iff the prompt is."""
    return calculate_baseline_and_std_per_prompt(
        groups, rewards, torch.ones_like(rewards), leave_one_out_baseline=False, std_rewards=unshaped
    )


def _complete(have: int, target: int, num_gen_batches: int, max_gen_batches: int, key: str) -> bool:
    """Whether `have` surviving rows complete the step; raises once more than `max_gen_batches` generation batches
    left it short."""
    if have >= target:
        return True
    if num_gen_batches > max_gen_batches:
        raise ValueError(
            f"dynamic sampling reached the maximum allowed number of generation batches ({key}={max_gen_batches}) "
            f"with only {have}/{target} rows of non-zero reward std; raise the limit or check the reward"
        )
    return False


def dynamic_sampling(
    repeated_batch: BatchedDataDict,
    std: torch.Tensor,
    baseline: torch.Tensor,
    num_gen_batches: int,
    cfg: MasterConfig,
    batch_cache: BatchedDataDict | None = None,
    pad_value_dict: dict[str, int] | None = None,
) -> tuple[BatchedDataDict, bool, BatchedDataDict | None, dict[str, float]]:
    """The legacy trainers' filter on a BatchedDataDict. Returns (batch, is_complete, cache, metrics).

    Reads the run's algorithm block (`cfg.rollout`): off, the batch passes through with its `baseline` and `std`
    stamped. On, survivors (`filtered_reward` = their `total_reward`) join `batch_cache`; the step's batch is its
    first `num_prompts_per_step x G` rows once it holds them.
    """
    if batch_cache is not None and not isinstance(batch_cache, BatchedDataDict):  # e.g. the reference's timer
        raise TypeError(
            f"dynamic_sampling's batch_cache must be a BatchedDataDict or None, got {type(batch_cache).__name__} "
            "(relayrl's dynamic_sampling takes no timer argument)"
        )
    r = cfg.rollout
    repeated_batch["baseline"] = baseline  # [B]
    repeated_batch["std"] = std  # [B]
    if not r.use_dynamic_sampling:
        return repeated_batch, True, batch_cache, {}
    target = r.rows_per_step
    kept = torch.nonzero(std != 0).flatten()
    if kept.numel():
        filtered = repeated_batch.select_indices(kept)
        filtered["filtered_reward"] = filtered["total_reward"]
        batch_cache = (
            filtered if batch_cache is None else BatchedDataDict.from_batches([batch_cache, filtered], pad_value_dict)
        )
    metrics: dict[str, float] = {"dynamic_sampling_num_gen_batches": num_gen_batches}
    have = 0 if batch_cache is None else batch_cache.size
    key = f"{cfg.algorithm}.dynamic_sampling_max_gen_batches"
    if not _complete(have, target, num_gen_batches, r.dynamic_sampling_max_gen_batches, key):
        return repeated_batch, False, batch_cache, metrics
    assert batch_cache is not None
    metrics["dynamic_sampling_num_discarded_valid_samples"] = have - target
    return batch_cache.slice(0, target), True, None, metrics


#: (pending_meta, pending_carry, pending_unfiltered_rewards, is_complete, ds_metrics, unfiltered_for_log)
MetaFilterResult = tuple[
    KVBatchMeta | None, BatchedDataDict | None, list[torch.Tensor], bool, dict[str, float], torch.Tensor | None
]


def apply_dynamic_sampling(
    *,
    meta: KVBatchMeta,
    driver_carry: BatchedDataDict,
    pending_meta: KVBatchMeta | None,
    pending_carry: BatchedDataDict | None,
    pending_unfiltered_rewards: list[torch.Tensor],
    train_prompts_size: int,
    num_gen_batches: int,
    max_gen_batches: int,
    policy: DataPlanePolicy,
) -> MetaFilterResult:
    """The reference's signature (GRPO's block names the limit): `dynamic_sampling_on_meta` with section grpo."""
    return dynamic_sampling_on_meta(
        meta=meta,
        driver_carry=driver_carry,
        pending_meta=pending_meta,
        pending_carry=pending_carry,
        pending_unfiltered_rewards=pending_unfiltered_rewards,
        train_prompts_size=train_prompts_size,
        num_gen_batches=num_gen_batches,
        max_gen_batches=max_gen_batches,
        policy=policy,
        section="grpo",
    )


def dynamic_sampling_on_meta(
    *,
    meta: KVBatchMeta,
    driver_carry: BatchedDataDict,
    pending_meta: KVBatchMeta | None,
    pending_carry: BatchedDataDict | None,
    pending_unfiltered_rewards: list[torch.Tensor],
    train_prompts_size: int,
    num_gen_batches: int,
    max_gen_batches: int,
    policy: DataPlanePolicy,
    section: str,
) -> MetaFilterResult:
    """One dynamic-sampling iteration on metadata: drop zero-std rows (and their keys from the store), merge the
    survivors into the pending cache, report whether it reached `train_prompts_size` rows. `section` is the
    algorithm block (`grpo`, `ppo`) whose `dynamic_sampling_max_gen_batches` the failure names.

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
    metrics: dict[str, float] = {"dynamic_sampling_num_gen_batches": num_gen_batches}
    key = f"{section}.dynamic_sampling_max_gen_batches"
    try:
        complete = _complete(have, train_prompts_size, num_gen_batches, max_gen_batches, key)
    except ValueError:
        if pending_meta is not None:  # the run stops: nothing of the step may stay in the store
            policy.discard_samples(pending_meta.keys, pending_meta.partition_id)
        raise
    if not complete:
        return pending_meta, pending_carry, pending_unfiltered_rewards, False, metrics, None
    assert pending_meta is not None and pending_carry is not None
    metrics["dynamic_sampling_num_discarded_valid_samples"] = have - train_prompts_size
    if have > train_prompts_size:
        policy.discard_samples(pending_meta.keys[train_prompts_size:], pending_meta.partition_id)
        pending_meta = pending_meta.slice(0, train_prompts_size)
        pending_carry = pending_carry.slice(0, train_prompts_size)
    return pending_meta, pending_carry, [], True, metrics, torch.cat(pending_unfiltered_rewards)

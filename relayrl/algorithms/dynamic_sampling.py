"""Dynamic sampling on metadata (DAPO): keep only prompt groups whose rewards differ, across generation batches.

The data-plane GRPO step (`grpo_sync.GRPOSyncSteps`) filters on the per-row `std` tag it stamped on the handle,
never fetching a row: dropped rows leave the store at once, survivors stay under their keys and join a pending
batch until it holds a step's worth of rows. Same rule, order and metrics as the legacy trainer's filter.
"""

from __future__ import annotations

import torch

from relayrl.algorithms.protocols import DataPlanePolicy
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.distributed.batched_data_dict import BatchedDataDict

__all__ = ["apply_dynamic_sampling"]


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
) -> tuple[KVBatchMeta | None, BatchedDataDict | None, list[torch.Tensor], bool, dict[str, float], torch.Tensor | None]:
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
    metrics: dict[str, float] = {"dynamic_sampling_num_gen_batches": num_gen_batches}
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

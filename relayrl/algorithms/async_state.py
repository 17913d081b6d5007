"""Checkpointing asynchronous GRPO's rollouts in flight: the unconsumed batches (their store rows, carry and metrics),
the producer's position and its engine's RNG, in one state file (safetensors + JSON: nothing to unpickle).

A checkpoint is taken after the producer drained (it generated every batch the published weights allow), so the file
holds whole batches only; a resume writes their rows back under the same keys and partitions, and production goes on
from the saved position. Batches that the resumed run's staleness bound no longer admits are dropped and counted
(their prompts are not re-drawn: the loader is already past them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from relayrl.algorithms.async_rollouts import CLAIM_TASK, ProducedBatch, ProducerState
from relayrl.config import MasterConfig
from relayrl.data_plane.column_io import first_write, read_columns
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.data_plane.schema import DP_TRAIN_FIELDS, TRAIN_CONSUMER_TASKS
from relayrl.utils.checkpoint import GRPOSaveState
from relayrl.utils.state_file import load_state_file, save_state_file

__all__ = ["ASYNC_STATE", "load_producer_state", "restore_batches", "save_producer_state"]

#: File in step_N/ with the async producer's state.
ASYNC_STATE = "async_rollouts.safetensors"


def save_producer_state(path: Path, state: ProducerState, rng: Any, client: DataPlaneClient) -> None:
    """Write `state` with every unconsumed batch's rows (read back from the store, padded) to `path`."""
    batches = []
    for b in state.ready:
        meta = b.meta
        rows = read_columns(client, meta, list(meta.fields or []))
        batches.append(
            {
                "index": b.index,
                "epoch": b.epoch,
                "version": b.version,
                "partition_id": meta.partition_id,
                "keys": list(meta.keys),
                "tags": meta.tags,
                "extra_info": meta.extra_info,
                "task_name": meta.task_name,
                "rows": {k: v for k, v in rows.items()},
                "wire_carry": {
                    **b.wire_carry,
                    "dtypes": {k: _dtype_name(v) for k, v in b.wire_carry["dtypes"].items()},
                },
                "rollout_metrics": b.rollout_metrics,
                "store_metrics": b.store_metrics,
                "generation_s": b.generation_s,
                "generation_cpu_s": b.generation_cpu_s,
            }
        )
    save_state_file(
        path,
        {
            "next_index": state.next_index,
            "epoch": state.epoch,
            "version": state.version,
            "announced": [[e, i] for e, i in state.announced],
            "rng": rng,
            "batches": batches,
        },
    )


def load_producer_state(
    path: Path | None, save_state: GRPOSaveState, cfg: MasterConfig
) -> tuple[ProducerState, Any, int]:
    """(producer state, engine RNG or None, groups dropped as too stale) to resume from; a fresh run's (or a
    checkpoint without async state, e.g. a sync run's) starts producing at the next step from the loader's position."""
    done = save_state.total_steps
    if path is None or not path.is_file():
        fresh = ProducerState(next_index=done + 1, epoch=save_state.current_epoch, version=done)
        return fresh, None, 0
    raw = load_state_file(path)
    bound = cfg.grpo.async_grpo.max_trajectory_age_steps
    ready: list[ProducedBatch] = []
    dropped = 0
    for b in raw["batches"]:
        meta = KVBatchMeta(
            partition_id=b["partition_id"],
            keys=list(b["keys"]),
            fields=list(b["rows"]),
            sequence_lengths=[int(x) for x in b["rows"]["input_lengths"].tolist()],
            tags=b["tags"],
            extra_info=dict(b["extra_info"]),
            task_name=b["task_name"],
        )
        age = (int(b["index"]) - 1) - int(b["version"])  # its age when its step trains
        if age > bound or dropped:  # later batches go too: batches are consumed in order
            dropped += meta.size // cfg.grpo.num_generations_per_prompt
            continue
        produced = ProducedBatch(
            index=int(b["index"]), epoch=int(b["epoch"]), version=int(b["version"]), meta=meta,
            wire_carry={**b["wire_carry"], "dtypes": {k: getattr(torch, v) for k, v in b["wire_carry"]["dtypes"].items()}},
            rollout_metrics=b["rollout_metrics"], store_metrics=b["store_metrics"],
            generation_s=float(b["generation_s"]),
            generation_cpu_s=float(b["generation_cpu_s"]),
        )  # fmt: skip
        produced.rows = b["rows"]  # written back into the store by restore_batches
        ready.append(produced)
    announced: list[tuple[int, int | None]] = [(int(e), None if i is None else int(i)) for e, i in raw["announced"]]
    next_index = int(raw["next_index"])
    if dropped:  # production restarts at the first dropped index, with the prompts the loader holds next
        next_index = ready[-1].index + 1 if ready else done + 1
        kept = {b.index for b in ready}
        announced = [(e, i) for e, i in announced if i is None or i in kept or i <= done]
    state = ProducerState(
        next_index=next_index, epoch=int(raw["epoch"]), version=done, ready=ready, announced=announced
    )
    return state, raw["rng"], dropped


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def restore_batches(batches: list[ProducedBatch], client: DataPlaneClient, group_size: int) -> None:
    """Write restored batches back into their partitions under their original keys (the resumed store)."""
    for b in batches:
        rows, meta = b.rows, b.meta
        assert rows is not None, "restore_batches takes batches loaded by load_producer_state"
        client.register_partition(
            meta.partition_id, list(DP_TRAIN_FIELDS), meta.size, [*TRAIN_CONSUMER_TASKS, CLAIM_TASK], group_size
        )
        first_write(
            {k: rows[k] for k in meta.fields or []},
            keys=meta.keys,
            client=client,
            partition_id=meta.partition_id,
            extra_info=meta.extra_info,
            task_name=meta.task_name,
            tags=meta.tags,
        )
        b.rows = None

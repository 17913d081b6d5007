"""Checkpointing asynchronous GRPO's rollouts in flight: the unconsumed batches (their store rows, carry and metrics),
the producer's position and its engine's RNG, in one state file (safetensors + JSON: nothing to unpickle).

A checkpoint is taken after the producer drained (it generated every batch the published weights allow), so the file
holds whole batches only; a resume writes their rows back under the same keys and partitions, and production goes on
from the saved position. Batches that the resumed run's staleness bound no longer admits are dropped and counted
(their prompts are not re-drawn: the loader is already past them).

With `checkpointing.save_data_plane=true` the rows are not copied into this file: the checkpoint's `data_plane/`
store already holds each batch's partition (rows, tags and claim cursors), and the resume restores it before the
trainer starts. The file then keeps only each batch's description, and `restore_batches` reconciles the restored
store with it: every kept batch's partition must hold exactly its keys, unclaimed; the partitions of batches dropped
as too stale leave the store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from relayrl.algorithms.async_rollouts import CLAIM_TASK, ProducedBatch, ProducerState
from relayrl.config import MasterConfig
from relayrl.data_plane.column_io import first_write, read_columns
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.data_plane.schema import ASYNC_PARTITION_FIELDS, TRAIN_CONSUMER_TASKS
from relayrl.utils.checkpoint import GRPOSaveState
from relayrl.utils.state_file import CheckpointError, load_state_file, save_state_file

__all__ = ["ASYNC_STATE", "Restored", "load_producer_state", "restore_batches", "save_producer_state"]

#: File in step_N/ with the async producer's state.
ASYNC_STATE = "async_rollouts.safetensors"


class Restored(NamedTuple):
    """What a resume starts production from (`load_producer_state`)."""

    state: ProducerState
    rng: Any  # the engine's RNG state, or None for a fresh start
    dropped_groups: int  # groups of batches dropped as too stale for the resumed bound
    rows_in_store: bool  # the kept batches' rows come back with the checkpoint's data_plane/ store
    stale_partitions: list[str]  # partitions of dropped batches (in the restored store when rows_in_store)


def save_producer_state(
    path: Path, state: ProducerState, rng: Any, client: DataPlaneClient, *, rows_in_store: bool = False
) -> None:
    """Write `state` with every unconsumed batch's rows (read back from the store, padded) to `path`; with
    `rows_in_store` (the checkpoint saves the store itself) only each batch's fields and sequence lengths."""
    batches = []
    for b in state.ready:
        meta = b.meta
        if rows_in_store:
            where: dict[str, Any] = {
                "fields": list(meta.fields or []),
                "sequence_lengths": [int(x) for x in meta.sequence_lengths or []],
            }
        else:
            where = {"rows": read_columns(client, meta, list(meta.fields or []))}
        batches.append(
            {
                **where,
                "index": b.index,
                "epoch": b.epoch,
                "version": b.version,
                "partition_id": meta.partition_id,
                "keys": list(meta.keys),
                "tags": meta.tags,
                "extra_info": meta.extra_info,
                "task_name": meta.task_name,
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
            "rows_in_store": rows_in_store,
            "batches": batches,
        },
    )


def load_producer_state(path: Path | None, save_state: GRPOSaveState, cfg: MasterConfig) -> Restored:
    """The producer state, engine RNG and dropped (too stale) batches to resume from; a fresh run's (or a checkpoint
    without async state, e.g. a sync run's) starts producing at the next step from the loader's position."""
    done = save_state.total_steps
    if path is None or not path.is_file():
        fresh = ProducerState(next_index=done + 1, epoch=save_state.current_epoch, version=done)
        return Restored(fresh, None, 0, False, [])
    raw = load_state_file(path)
    in_store = bool(raw.get("rows_in_store", False))
    if in_store and not cfg.checkpointing.save_data_plane:
        raise CheckpointError(
            f"{path}: the rollouts in flight were saved in the checkpoint's data_plane/ store; resume with "
            "checkpointing.save_data_plane=true"
        )
    bound = cfg.grpo.async_grpo.max_trajectory_age_steps
    ready: list[ProducedBatch] = []
    dropped, stale = 0, []
    for b in raw["batches"]:
        lengths = b["sequence_lengths"] if in_store else b["rows"]["input_lengths"].tolist()
        meta = KVBatchMeta(
            partition_id=b["partition_id"],
            keys=list(b["keys"]),
            fields=list(b["fields"] if in_store else b["rows"]),
            sequence_lengths=[int(x) for x in lengths],
            tags=b["tags"],
            extra_info=dict(b["extra_info"]),
            task_name=b["task_name"],
        )
        age = (int(b["index"]) - 1) - int(b["version"])  # its age when its step trains
        if age > bound or dropped:  # later batches go too: batches are consumed in order
            dropped += meta.size // cfg.grpo.num_generations_per_prompt
            stale.append(meta.partition_id)
            continue
        produced = ProducedBatch(
            index=int(b["index"]), epoch=int(b["epoch"]), version=int(b["version"]), meta=meta,
            wire_carry={**b["wire_carry"], "dtypes": {k: getattr(torch, v) for k, v in b["wire_carry"]["dtypes"].items()}},
            rollout_metrics=b["rollout_metrics"], store_metrics=b["store_metrics"],
            generation_s=float(b["generation_s"]),
            generation_cpu_s=float(b["generation_cpu_s"]),
        )  # fmt: skip
        produced.rows = None if in_store else b["rows"]  # written back into the store by restore_batches
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
    return Restored(state, raw["rng"], dropped, in_store, stale)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def restore_batches(restored: Restored, client: DataPlaneClient, group_size: int) -> None:
    """Put the kept batches back in the resumed store: write their rows under their original keys and partitions,
    or, when the checkpoint's store came back with them, check it against them (`reconcile_store`)."""
    if restored.rows_in_store:
        reconcile_store(restored, client)
        return
    for b in restored.state.ready:
        rows, meta = b.rows, b.meta
        assert rows is not None, "restore_batches takes batches loaded by load_producer_state"
        client.register_partition(
            meta.partition_id, list(ASYNC_PARTITION_FIELDS), meta.size, [*TRAIN_CONSUMER_TASKS, CLAIM_TASK], group_size
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


def reconcile_store(restored: Restored, client: DataPlaneClient) -> None:
    """The restored store against the producer state: each kept batch's partition holds exactly its keys, every
    field of it written, and no task's claim cursor past any of them (a batch in flight was claimed by nobody, so its
    step claims it whole); the partitions of dropped batches leave the store. Anything else is a `CheckpointError`."""
    states = client.export_state()
    for b in restored.state.ready:
        pid, keys = b.meta.partition_id, list(b.meta.keys)
        part = states.get(pid)
        if part is None:
            raise CheckpointError(
                f"the restored data plane store has no partition {pid!r} for batch {b.index} in flight"
            )
        problem = None
        if part["keys"] != keys:
            problem = f"holds {len(part['keys'])} keys, the batch {len(keys)}"
        elif any(part["written"].get(f) != keys for f in b.meta.fields or []):
            problem = "misses rows of a field"
        elif any(claimed for claimed in part["consumed"].values()):
            task = next(t for t, claimed in part["consumed"].items() if claimed)
            problem = f"has keys claimed by {task!r}"
        if problem is not None:
            raise CheckpointError(f"restored data plane partition {pid!r} (batch {b.index} in flight) {problem}")
    for pid in restored.stale_partitions:  # counted in dropped_groups; nobody will train on them
        if pid in states:
            client.clear_samples(None, pid)
            client.drop_partition(pid)

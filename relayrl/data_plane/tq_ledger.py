"""Bookkeeping for the `transfer_queue` backend: what TransferQueue does not track strictly enough.

The ledger holds no tensors. Per partition it records the declaration (fields, expected samples, consumer tasks),
each field's schema as fixed by its first write (layout, dtype, trailing shape), the live keys in first-put
order with the fields written for each (and their lengths and bytes), tags and per-task cursors. It runs as one
named Ray actor shared by every process, so checks are atomic across writers. Its semantics mirror
`memory.ColumnarStore` exactly, so the three backends answer the contract suite identically.

A put is two-phase: `begin_put` validates and reserves (counted against capacity, not yet visible), the adapter
writes to TQ and verifies, then `commit_put` publishes every key and field at once (or `abort_put` undoes it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.data_plane.interfaces import (
    CapacityExceededError,
    ClaimTimeoutError,
    DataPlaneClosedError,
    FieldNotWrittenError,
    KVBatchMeta,
    MissingKeysError,
    SchemaMismatchError,
    UnknownFieldError,
    UnknownPartitionError,
    UnknownTaskError,
    format_keys,
)
from relayrl.data_plane.ray_store import carry

FieldSpec = tuple[bool, str, tuple[int, ...]]
"""(jagged, dtype name, trailing shape) of a field, fixed by its first write."""
RowInfo = tuple[int, int]
"""(length or -1 for dense, payload bytes) of one written (key, field)."""


def _describe(spec: FieldSpec) -> str:
    return f"{'jagged' if spec[0] else 'dense'} torch.{spec[1]} trailing shape {tuple(spec[2])}"


@dataclass
class _Part:
    fields: list[str]
    num_samples: int
    tasks: list[str]
    grpo_group_size: int | None
    keys: dict[str, dict[str, RowInfo]] = field(default_factory=dict)  # committed keys, first-put order
    reserved: set[str] = field(default_factory=set)  # new keys of puts in flight
    schema: dict[str, FieldSpec] = field(default_factory=dict)
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)
    consumed: dict[str, set[str]] = field(default_factory=dict)


class Ledger:
    """Thread-safe partition bookkeeping (see module docstring)."""

    def __init__(self, storage_capacity: int):
        if storage_capacity < 1:
            raise ValueError(f"storage_capacity must be >= 1, got {storage_capacity}")
        self.storage_capacity = storage_capacity
        self._parts: dict[str, _Part] = {}
        self._closed = False
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)

    def ping(self) -> bool:
        return True

    def _part(self, partition_id: str) -> _Part:
        if self._closed:
            raise DataPlaneClosedError("the transfer_queue data plane is closed")
        part = self._parts.get(partition_id)
        if part is None:
            raise UnknownPartitionError(
                f"partition {partition_id!r} is not registered (registered: {sorted(self._parts)})"
            )
        return part

    @staticmethod
    def _check_declared(part: _Part, partition_id: str, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in part.fields]
        if unknown:
            raise UnknownFieldError(
                f"field(s) {unknown} not declared for partition {partition_id!r} (declared: {part.fields})"
            )

    def _held(self) -> int:
        return sum(len(p.keys) + len(p.reserved) for p in self._parts.values())

    # ------------------------------------------------------------------ declaration and claims
    def register_partition(
        self, partition_id: str, fields: list[str], num_samples: int, tasks: list[str], grpo_group_size: int | None
    ) -> bool:
        """Declare (or re-declare an empty) partition; returns whether it existed before."""
        if not isinstance(partition_id, str) or not partition_id:
            raise ValueError(f"partition_id must be a non-empty string, got {partition_id!r}")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if grpo_group_size is not None and grpo_group_size < 1:
            raise ValueError(f"grpo_group_size must be >= 1, got {grpo_group_size}")
        with self._lock:
            if self._closed:
                raise DataPlaneClosedError("the transfer_queue data plane is closed")
            old = self._parts.get(partition_id)
            if old is not None and (old.keys or old.reserved):
                raise ValueError(
                    f"partition {partition_id!r} still holds {len(old.keys)} samples; "
                    "clear_samples(None, partition_id) before re-registering it"
                )
            uniq_tasks = list(dict.fromkeys(tasks))
            self._parts[partition_id] = _Part(
                list(dict.fromkeys(fields)),
                num_samples,
                uniq_tasks,
                grpo_group_size,
                consumed={t: set() for t in uniq_tasks},
            )
            self._changed.notify_all()
            return old is not None

    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required: list[str],
        batch_size: int,
        dp_rank: int | None,
        blocking: bool,
        timeout_s: float,
    ) -> KVBatchMeta:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dp_rank is not None and dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            while True:
                part = self._part(partition_id)
                if task_name not in part.consumed:
                    raise UnknownTaskError(
                        f"task {task_name!r} is not a consumer task of partition {partition_id!r} (tasks: {part.tasks})"
                    )
                self._check_declared(part, partition_id, required)
                consumed = part.consumed[task_name]
                ready = [
                    k for k, written in part.keys.items() if k not in consumed and all(f in written for f in required)
                ][:batch_size]
                drained = len(consumed) + len(ready) >= part.num_samples
                if not blocking or len(ready) >= batch_size or drained:
                    consumed.update(ready)
                    return self._claimed(part, partition_id, task_name, required, ready)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClaimTimeoutError(
                        f"claim_meta(partition={partition_id!r}, task={task_name!r}) timed out after {timeout_s}s "
                        f"with {len(ready)} of {batch_size} samples ready"
                    )
                self._changed.wait(remaining)

    @staticmethod
    def _claimed(part: _Part, partition_id: str, task: str, required: list[str], keys: list[str]) -> KVBatchMeta:
        jagged = [n for n in required if part.schema[n][0]] if keys else []
        lens = [part.keys[k][jagged[0]][0] for k in keys] if jagged else None
        tags = [dict(part.tags.get(k, {})) for k in keys] if any(k in part.tags for k in keys) else None
        return KVBatchMeta(partition_id, list(keys), list(required), lens, tags, {}, task)

    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> bool:
        with self._lock:
            part = self._part(partition_id)
            for task in task_names:
                if task not in part.consumed:
                    raise UnknownTaskError(f"task {task!r} is not a consumer task of partition {partition_id!r}")
                if any(k not in part.consumed[task] for k in part.keys):
                    return False
            return True

    # ------------------------------------------------------------------ puts (two-phase)
    def begin_put(self, partition_id: str, keys: list[str], specs: dict[str, FieldSpec]) -> tuple[list[str], list[str]]:
        """Validate a put completely and reserve its new keys; returns (new keys, fields written for the first
        time) so that `abort_put` can undo exactly this reservation."""
        with self._lock:
            part = self._part(partition_id)
            self._check_declared(part, partition_id, list(specs))
            for name, spec in specs.items():
                spec = (spec[0], spec[1], tuple(spec[2]))
                old = part.schema.get(name)
                if old is not None and old != spec:
                    raise SchemaMismatchError(
                        f"field '{name}' of partition {partition_id!r} was first written as {_describe(old)}; "
                        f"this write is {_describe(spec)} (the data plane never casts)"
                    )
            new_keys = [k for k in keys if k not in part.keys and k not in part.reserved]
            held = self._held()
            if held + len(new_keys) > self.storage_capacity:
                raise CapacityExceededError(
                    f"put of {len(new_keys)} new samples to {partition_id!r} would hold {held + len(new_keys)} "
                    f"samples, above data_plane.storage_capacity={self.storage_capacity}; clear consumed samples "
                    "or raise the capacity"
                )
            new_fields = [name for name in specs if name not in part.schema]
            for name in new_fields:
                part.schema[name] = (specs[name][0], specs[name][1], tuple(specs[name][2]))
            part.reserved.update(new_keys)
            return new_keys, new_fields

    def commit_put(
        self,
        partition_id: str,
        keys: list[str],
        rows: dict[str, tuple[list[int] | None, list[int]]],
        tags: list[dict[str, Any]] | None,
    ) -> None:
        """Publish a verified put: every key and field becomes visible at once."""
        with self._lock:
            part = self._part(partition_id)
            for i, k in enumerate(keys):
                part.reserved.discard(k)
                written = part.keys.setdefault(k, {})
                for name, (lengths, nbytes) in rows.items():
                    written[name] = (-1 if lengths is None else lengths[i], nbytes[i])
            if tags is not None:
                for k, t in zip(keys, tags):
                    part.tags.setdefault(k, {}).update(t)
            self._changed.notify_all()

    def abort_put(
        self, partition_id: str, keys: list[str], new_keys: list[str], sent_fields: list[str], new_fields: list[str]
    ) -> None:
        """Undo `begin_put`; `sent_fields` were (maybe partly) written to TQ, so overwritten keys lose them."""
        with self._lock:
            part = self._parts.get(partition_id)
            if part is None:
                return
            part.reserved.difference_update(new_keys)
            for k in keys:
                written = part.keys.get(k)
                if written is not None:
                    for name in sent_fields:
                        written.pop(name, None)
            for name in new_fields:
                if not any(name in w for w in part.keys.values()):
                    part.schema.pop(name, None)

    # ------------------------------------------------------------------ gets and clears
    def check_get(self, partition_id: str, keys: list[str], names: list[str]) -> dict[str, FieldSpec]:
        """Raise exactly what the memory store would for this get; else return the schema of `names`."""
        with self._lock:
            part = self._part(partition_id)
            self._check_declared(part, partition_id, names)
            missing = [k for k in keys if k not in part.keys]
            if missing:
                raise MissingKeysError(
                    f"{len(missing)} key(s) not in partition {partition_id!r}: {format_keys(missing)}", missing
                )
            for name in names:
                if name not in part.schema:
                    raise FieldNotWrittenError(
                        f"field '{name}' has not been written in partition {partition_id!r}", list(keys)
                    )
                lacking = [k for k in keys if name not in part.keys[k]]
                if lacking:
                    raise FieldNotWrittenError(
                        f"field '{name}' not yet written for {len(lacking)} key(s) of partition {partition_id!r}: "
                        f"{format_keys(lacking)}",
                        lacking,
                    )
            return {name: part.schema[name] for name in names}

    def present(self, partition_id: str, keys: list[str] | None) -> list[str]:
        """The live keys among `keys` (all live keys for None), de-duplicated."""
        with self._lock:
            part = self._part(partition_id)
            if keys is None:
                return list(part.keys)
            return [k for k in dict.fromkeys(keys) if k in part.keys]

    def remove(self, partition_id: str, keys: list[str]) -> int:
        with self._lock:
            part = self._part(partition_id)
            gone = [k for k in dict.fromkeys(keys) if k in part.keys]
            for k in gone:
                del part.keys[k]
                part.tags.pop(k, None)
                for consumed in part.consumed.values():
                    consumed.discard(k)
            if gone:
                self._changed.notify_all()
            return len(gone)

    # ------------------------------------------------------------------ lifecycle and introspection
    def bytes_held(self) -> dict[str, int]:
        with self._lock:
            return {pid: sum(b for w in p.keys.values() for _, b in w.values()) for pid, p in self._parts.items()}

    def num_samples_held(self) -> int:
        with self._lock:
            return self._held()

    def keys(self, partition_id: str) -> list[str]:
        with self._lock:
            return list(self._part(partition_id).keys)

    def reset(self, storage_capacity: int | None) -> list[str]:
        """Forget every partition (optionally changing the capacity); returns the dropped partition ids."""
        with self._lock:
            if storage_capacity is not None and storage_capacity < 1:
                raise ValueError(f"storage_capacity must be >= 1, got {storage_capacity}")
            dropped = list(self._parts)
            self._parts.clear()
            self.storage_capacity = storage_capacity or self.storage_capacity
            self._changed.notify_all()
            return dropped

    def close(self) -> None:
        with self._lock:
            self._parts.clear()
            self._closed = True
            self._changed.notify_all()


class LedgerActor:
    """The ledger as a Ray actor: same methods, errors carried across the process boundary intact."""

    def __init__(self, storage_capacity: int):
        self._ledger = Ledger(storage_capacity)

    def ping(self) -> bool:
        return True

    def register_partition(self, *a: Any) -> bool:
        return carry(lambda: self._ledger.register_partition(*a))

    def claim_meta(self, *a: Any) -> KVBatchMeta:
        return carry(lambda: self._ledger.claim_meta(*a))

    def check_consumption_status(self, *a: Any) -> bool:
        return carry(lambda: self._ledger.check_consumption_status(*a))

    def begin_put(self, *a: Any) -> tuple[list[str], list[str]]:
        return carry(lambda: self._ledger.begin_put(*a))

    def commit_put(self, *a: Any) -> None:
        return carry(lambda: self._ledger.commit_put(*a))

    def abort_put(self, *a: Any) -> None:
        return carry(lambda: self._ledger.abort_put(*a))

    def check_get(self, *a: Any) -> dict[str, FieldSpec]:
        return carry(lambda: self._ledger.check_get(*a))

    def present(self, *a: Any) -> list[str]:
        return carry(lambda: self._ledger.present(*a))

    def remove(self, *a: Any) -> int:
        return carry(lambda: self._ledger.remove(*a))

    def bytes_held(self) -> dict[str, int]:
        return self._ledger.bytes_held()

    def num_samples_held(self) -> int:
        return self._ledger.num_samples_held()

    def keys(self, *a: Any) -> list[str]:
        return carry(lambda: self._ledger.keys(*a))

    def reset(self, *a: Any) -> list[str]:
        return carry(lambda: self._ledger.reset(*a))

    def close(self) -> None:
        self._ledger.close()

"""The one ledger every backend keeps: partitions, field schemas, live keys, written fields, tags, capacity and
per-task cursors. It holds no tensor data.

Why one: the contract's strictness (what a bad get raises, when a claim is ready, what counts against capacity)
has to be identical on every backend. `memory.ColumnarStore` is this ledger plus packed tensor segments (the `ray`
backend hosts that store in an actor); the `transfer_queue` adapter keeps its bulk data in TransferQueue and asks a
hosted plain `Ledger` (`remote.LedgerHost`) for everything else.

Per partition each live key gets a row id (first-put order), and each field one int64 array over row ids: -1 where
the field is not written, else the row's token count (jagged) or 1 (dense). Readiness, claimed lengths and
missing-field checks are vector ops over those arrays, never a Python object per sample.

A put has two phases: `begin_put` validates everything and reserves the new keys (they count against capacity but
are not visible), `commit_put` publishes every key and field at once, `abort_put` undoes a reservation. The memory
store runs both phases in one lock hold; the TQ adapter writes to TransferQueue between them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from relayrl.data_plane.codec import FieldSpec
from relayrl.data_plane.interfaces import (
    CapacityExceededError,
    ClaimTimeoutError,
    DataPlaneClosedError,
    FieldNotWrittenError,
    KVBatchMeta,
    MissingKeysError,
    SchemaMismatchError,
    Tags,
    UnknownFieldError,
    UnknownPartitionError,
    UnknownTaskError,
    format_keys,
)
from relayrl.data_plane.ledger_state import LedgerStateMixin


@dataclass
class PartitionRecord:
    fields: list[str]
    num_samples: int
    tasks: list[str]
    grpo_group_size: int | None
    rows: dict[str, int] = field(default_factory=dict)  # live key -> row id, in first-put order
    reserved: set[str] = field(default_factory=set)  # new keys of puts in flight
    schema: dict[str, FieldSpec] = field(default_factory=dict)
    written: dict[str, torch.Tensor] = field(default_factory=dict)  # field -> [row_capacity] int64, -1 = not written
    checksums: dict[str, torch.Tensor] = field(default_factory=dict)  # field -> [row_capacity] int64, -1 = none
    next_row: int = 0
    row_capacity: int = 0
    tags: dict[str, Tags] = field(default_factory=dict)
    consumed: dict[str, set[str]] = field(default_factory=dict)

    def grow(self, needed: int) -> None:
        if needed <= self.row_capacity:
            return
        cap = max(needed, 2 * self.row_capacity, 1024)
        for arrays in (self.written, self.checksums):
            for name, old in arrays.items():
                arrays[name] = torch.cat([old, torch.full((cap - old.shape[0],), -1, dtype=torch.int64)])
        self.row_capacity = cap

    def checksums_of(self, rows: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Each field's recorded checksums of `rows` `[n]` (-1 where none was recorded)."""
        out = {}
        for name in names:
            sums = self.checksums.get(name)
            out[name] = torch.full((rows.shape[0],), -1, dtype=torch.int64) if sums is None else sums[rows]
        return out

    def row_ids(self, keys: Sequence[str]) -> torch.Tensor:
        return torch.tensor([self.rows[k] for k in keys], dtype=torch.int64)  # [n]


class Ledger(LedgerStateMixin):
    """Thread-safe partition bookkeeping implementing the non-tensor half of `DataPlaneClient` (see module doc)."""

    def __init__(self, storage_capacity: int = 1_000_000):
        if storage_capacity < 1:
            raise ValueError(f"storage_capacity must be >= 1, got {storage_capacity}")
        self.storage_capacity = storage_capacity
        self._parts: dict[str, PartitionRecord] = {}
        self._closed = False
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ helpers
    def _forget(self, partition_id: str, rows: torch.Tensor | None) -> None:
        """Hook: rows `rows` [n] of a partition hold nothing any more (None: no row does). The ledger keeps no data."""

    def _part(self, partition_id: str) -> PartitionRecord:
        if self._closed:
            raise DataPlaneClosedError("the data plane store is closed")
        part = self._parts.get(partition_id)
        if part is None:
            raise UnknownPartitionError(
                f"partition {partition_id!r} is not registered (registered: {sorted(self._parts)})"
            )
        return part

    @staticmethod
    def _check_declared(part: PartitionRecord, partition_id: str, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in part.fields]
        if unknown:
            raise UnknownFieldError(
                f"field(s) {unknown} not declared for partition {partition_id!r} (declared: {part.fields})"
            )

    def _held(self) -> int:
        return sum(len(p.rows) + len(p.reserved) for p in self._parts.values())

    def _empty(self, partition_id: str, part: PartitionRecord) -> None:
        """Drop every sample of a partition; its declaration and field schemas stay. Row ids restart at 0 so a
        long-lived partition's arrays do not grow forever."""
        part.rows.clear()
        part.tags.clear()
        for consumed in part.consumed.values():
            consumed.clear()
        for name in part.written:
            part.written[name] = torch.empty(0, dtype=torch.int64)
        part.checksums.clear()
        part.next_row = part.row_capacity = 0
        self._forget(partition_id, None)

    # ------------------------------------------------------------------ declaration and claims
    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int,
        consumer_tasks: Sequence[str],
        grpo_group_size: int | None = None,
    ) -> None:
        if not isinstance(partition_id, str) or not partition_id:
            raise ValueError(f"partition_id must be a non-empty string, got {partition_id!r}")
        if isinstance(fields, str) or isinstance(consumer_tasks, str):
            raise TypeError("fields and consumer_tasks must be sequences of names, not a single string")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if grpo_group_size is not None and grpo_group_size < 1:
            raise ValueError(f"grpo_group_size must be >= 1, got {grpo_group_size}")
        with self._lock:
            if self._closed:
                raise DataPlaneClosedError("the data plane store is closed")
            old = self._parts.get(partition_id)
            if old is not None and (old.rows or old.reserved):
                raise ValueError(
                    f"partition {partition_id!r} still holds {len(old.rows)} samples; "
                    "clear_samples(None, partition_id) before re-registering it"
                )
            tasks = list(dict.fromkeys(consumer_tasks))
            self._parts[partition_id] = PartitionRecord(
                list(dict.fromkeys(fields)), num_samples, tasks, grpo_group_size, consumed={t: set() for t in tasks}
            )
            self._forget(partition_id, None)
            self._changed.notify_all()

    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
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
                self._check_declared(part, partition_id, required_fields)
                consumed = part.consumed[task_name]
                ready = self._ready_keys(part, consumed, required_fields, batch_size)
                drained = len(consumed) + len(ready) >= part.num_samples
                if not blocking or len(ready) >= batch_size or drained:
                    consumed.update(ready)
                    return self._claimed_meta(part, partition_id, task_name, required_fields, ready)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClaimTimeoutError(
                        f"claim_meta(partition={partition_id!r}, task={task_name!r}) timed out after {timeout_s}s "
                        f"with {len(ready)} of {batch_size} samples ready"
                    )
                self._changed.wait(remaining)

    @staticmethod
    def _ready_keys(part: PartitionRecord, consumed: set[str], required: Sequence[str], limit: int) -> list[str]:
        """Up to `limit` live keys, in put order, that the task has not consumed and that hold every required field."""
        cand = [k for k in part.rows if k not in consumed]
        if not cand or not required:
            return cand[:limit]
        rows = part.row_ids(cand)  # [n]
        ok = torch.ones(len(cand), dtype=torch.bool)  # [n]
        for name in required:
            written = part.written.get(name)
            if written is None:
                return []
            ok &= written.index_select(0, rows) >= 0
        return [cand[i] for i in ok.nonzero().squeeze(1)[:limit].tolist()]

    @staticmethod
    def _claimed_meta(
        part: PartitionRecord, partition_id: str, task: str, required: Sequence[str], keys: list[str]
    ) -> KVBatchMeta:
        jagged = [n for n in required if part.schema[n].jagged] if keys else []
        lens = part.written[jagged[0]].index_select(0, part.row_ids(keys)).tolist() if jagged else None
        tags = [dict(part.tags.get(k, {})) for k in keys] if any(k in part.tags for k in keys) else None
        return KVBatchMeta(partition_id, list(keys), list(required), lens, tags, {}, task)

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        with self._lock:
            part = self._part(partition_id)
            for task in task_names:
                if task not in part.consumed:
                    raise UnknownTaskError(f"task {task!r} is not a consumer task of partition {partition_id!r}")
                if any(k not in part.consumed[task] for k in part.rows):
                    return False
            return True

    # ------------------------------------------------------------------ puts (two-phase)
    def begin_put(
        self, partition_id: str, keys: list[str], specs: Mapping[str, FieldSpec]
    ) -> tuple[list[str], list[str]]:
        """Validate a put completely and reserve its new keys; returns (new keys, fields written for the first
        time), which is what `abort_put` needs to undo exactly this reservation."""
        with self._lock:
            return self._reserve(self._part(partition_id), partition_id, keys, specs)

    def _reserve(
        self, part: PartitionRecord, partition_id: str, keys: list[str], specs: Mapping[str, FieldSpec]
    ) -> tuple[list[str], list[str]]:
        self._check_declared(part, partition_id, list(specs))
        for name, spec in specs.items():
            old = part.schema.get(name)
            if old is not None and old != spec:
                raise SchemaMismatchError(
                    f"field '{name}' of partition {partition_id!r} was first written as {old.describe()}; "
                    f"this write is {spec.describe()} (the data plane never casts)"
                )
        new_keys = [k for k in keys if k not in part.rows and k not in part.reserved]
        held = self._held()
        if held + len(new_keys) > self.storage_capacity:
            raise CapacityExceededError(
                f"put of {len(new_keys)} new samples to {partition_id!r} would hold {held + len(new_keys)} "
                f"samples, above data_plane.storage_capacity={self.storage_capacity}; clear consumed samples "
                "or raise the capacity"
            )
        new_fields = [name for name in specs if name not in part.schema]
        for name in new_fields:
            part.schema[name] = specs[name]
            part.written[name] = torch.full((part.row_capacity,), -1, dtype=torch.int64)
        part.reserved.update(new_keys)
        return new_keys, new_fields

    def commit_put(
        self,
        partition_id: str,
        keys: list[str],
        lengths: Mapping[str, torch.Tensor | None],
        tags: Sequence[Tags] | None,
        checksums: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Publish a reserved put: every key and field becomes visible at once. `lengths[name]` is the field's
        `[n]` token counts (jagged) or None (dense); `checksums[name]` its `[n]` row checksums, if computed."""
        with self._lock:
            self._publish(self._part(partition_id), keys, lengths, tags, checksums)
            self._changed.notify_all()

    @staticmethod
    def _publish(
        part: PartitionRecord,
        keys: list[str],
        lengths: Mapping[str, torch.Tensor | None],
        tags: Sequence[Tags] | None,
        checksums: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Row ids for new keys, written marks, checksums, tags; returns the put's row ids `[n]` in key order."""
        new_keys = [k for k in keys if k not in part.rows]
        part.reserved.difference_update(new_keys)
        first = part.next_row
        part.grow(first + len(new_keys))
        part.rows.update(zip(new_keys, range(first, first + len(new_keys))))
        part.next_row += len(new_keys)
        if len(new_keys) == len(keys):  # the common first write: one fresh range
            rows = torch.arange(first, first + len(keys), dtype=torch.int64)  # [n]
        else:
            rows = part.row_ids(keys)  # [n]
        for name, lens in lengths.items():
            mark = torch.ones(len(keys), dtype=torch.int64) if lens is None else lens  # [n]
            part.written[name].index_copy_(0, rows, mark)
            sums = None if checksums is None else checksums.get(name)
            if sums is not None:
                if name not in part.checksums:
                    part.checksums[name] = torch.full((part.row_capacity,), -1, dtype=torch.int64)
                part.checksums[name].index_copy_(0, rows, sums.to(torch.int64))
            elif name in part.checksums:  # written without one: an older checksum must not vouch for it
                part.checksums[name].index_fill_(0, rows, -1)
        if tags is not None:
            for k, t in zip(keys, tags):
                part.tags.setdefault(k, {}).update(t)
        return rows

    def abort_put(
        self, partition_id: str, keys: list[str], new_keys: list[str], sent_fields: list[str], new_fields: list[str]
    ) -> None:
        """Undo `begin_put`. `sent_fields` may be partly written in the bulk store, so the overwritten keys lose
        them: a later get names them as not written instead of returning a mix of old and new values."""
        with self._lock:
            part = self._parts.get(partition_id)
            if part is None:
                return
            part.reserved.difference_update(new_keys)
            old = [k for k in keys if k in part.rows]
            if old:
                rows = part.row_ids(old)  # [n]
                for name in sent_fields:
                    part.written[name].index_fill_(0, rows, -1)
            for name in new_fields:
                if not bool((part.written[name] >= 0).any()):
                    del part.schema[name], part.written[name]

    # ------------------------------------------------------------------ gets and clears
    def check_get(self, partition_id: str, keys: list[str], names: list[str]) -> dict[str, FieldSpec]:
        """Raise what a get of `names` for `keys` must raise; else return the schema of `names`."""
        with self._lock:
            part = self._part(partition_id)
            self._rows_for_get(part, partition_id, keys, names)
            return {name: part.schema[name] for name in names}

    def check_get_checksums(
        self, partition_id: str, keys: list[str], names: list[str]
    ) -> tuple[dict[str, FieldSpec], dict[str, torch.Tensor]]:
        """`check_get`, plus each field's recorded row checksums `[n]` in `keys` order (-1: none recorded)."""
        with self._lock:
            part = self._part(partition_id)
            rows = self._rows_for_get(part, partition_id, keys, names)  # [n]
            return {name: part.schema[name] for name in names}, part.checksums_of(rows, names)

    def _rows_for_get(
        self, part: PartitionRecord, partition_id: str, keys: list[str], names: list[str]
    ) -> torch.Tensor:
        """Row ids `[n]` of `keys` once every key is live and every field in `names` written for all of them."""
        self._check_declared(part, partition_id, names)
        row_list = [part.rows.get(k, -1) for k in keys]
        missing = [k for k, r in zip(keys, row_list) if r < 0]
        if missing:
            raise MissingKeysError(
                f"{len(missing)} key(s) not in partition {partition_id!r}: {format_keys(missing)}", missing
            )
        rows = torch.tensor(row_list, dtype=torch.int64)  # [n]
        for name in names:
            if name not in part.schema:
                raise FieldNotWrittenError(
                    f"field '{name}' has not been written in partition {partition_id!r}", list(keys)
                )
            marks = part.written[name].index_select(0, rows)  # [n], -1 = not written
            if keys and int(marks.min()) < 0:
                lacking = [k for k, m in zip(keys, marks.tolist()) if m < 0]
                raise FieldNotWrittenError(
                    f"field '{name}' not yet written for {len(lacking)} key(s) of partition {partition_id!r}: "
                    f"{format_keys(lacking)}",
                    lacking,
                )
        return rows

    def present(self, partition_id: str, keys: list[str] | None) -> list[str]:
        """The live keys among `keys` (every live key for None), de-duplicated."""
        with self._lock:
            part = self._part(partition_id)
            if keys is None:
                return list(part.rows)
            return [k for k in dict.fromkeys(keys) if k in part.rows]

    def clear_samples(self, keys: Sequence[str] | None, partition_id: str) -> int:
        with self._lock:
            part = self._part(partition_id)
            if keys is None:  # everything: reset instead of releasing row by row
                count = len(part.rows)
                self._empty(partition_id, part)
                self._changed.notify_all()
                return count
            if isinstance(keys, str):
                raise TypeError("clear_samples takes a sequence of keys (or None), not a single string")
            gone = [k for k in dict.fromkeys(keys) if k in part.rows]
            if not gone:
                return 0
            rows = torch.tensor([part.rows.pop(k) for k in gone], dtype=torch.int64)  # [n]
            for written in part.written.values():
                written.index_fill_(0, rows, -1)
            self._forget(partition_id, rows)
            for k in gone:
                part.tags.pop(k, None)
                for consumed in part.consumed.values():
                    consumed.discard(k)
            if not part.rows:
                self._empty(partition_id, part)
            self._changed.notify_all()
            return len(gone)

    def drop_partition(self, partition_id: str) -> bool:
        """Forget an empty partition's declaration (a per-batch partition retired after its step), so a long run
        does not keep one per step. ValueError while it holds samples; False if it was not registered."""
        with self._lock:
            if self._closed:
                raise DataPlaneClosedError("the data plane store is closed")
            part = self._parts.get(partition_id)
            if part is None:
                return False
            if part.rows or part.reserved:
                raise ValueError(
                    f"partition {partition_id!r} still holds {len(part.rows) + len(part.reserved)} samples; "
                    "clear_samples(None, partition_id) before dropping it"
                )
            self._forget(partition_id, None)
            del self._parts[partition_id]
            self._changed.notify_all()
            return True

    # ------------------------------------------------------------------ lifecycle and introspection
    def bytes_held(self) -> dict[str, int]:
        """Payload bytes of every written (key, field): tokens x width + 8 (its length) jagged, width dense."""
        with self._lock:
            out = {}
            for pid, part in self._parts.items():
                total = 0
                for name, written in part.written.items():
                    spec, live = part.schema[name], written[written >= 0]  # [n live]
                    total += (
                        (int(live.sum()) * spec.width + 8 * live.numel()) if spec.jagged else spec.width * live.numel()
                    )
                out[pid] = total
            return out

    def num_samples_held(self) -> int:
        with self._lock:
            return self._held()

    def keys(self, partition_id: str) -> list[str]:
        """Live keys of a partition in first-put order."""
        with self._lock:
            return list(self._part(partition_id).rows)

    def close(self) -> None:
        with self._lock:
            for pid in self._parts:
                self._forget(pid, None)
            self._parts.clear()
            self._closed = True
            self._changed.notify_all()

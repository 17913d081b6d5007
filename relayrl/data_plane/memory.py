"""The embedded `memory` backend: a columnar, in-process, thread-safe store.

Layout (where the speed comes from): each put stores, per field, ONE segment — a packed `values` tensor plus
`offsets`/`lengths` for jagged fields — and records where every row landed in two int64 arrays per field
(`loc_seg`, `loc_pos`, indexed by a partition-local row id). There is never one Python object per sample for
tensor data. A get looks up row ids once, then per field gathers with one slice (contiguous rows) or one
`index_select` over a flat token index per segment. A write-back adds a segment without touching existing ones.
A segment is freed when its last live row is cleared or overwritten.

`ColumnarStore` is a plain object (the Ray backend hosts one in an actor); `MemoryDataPlaneClient` wraps it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column, as_column, flat_token_index
from relayrl.data_plane.interfaces import (
    CapacityExceededError,
    ClaimTimeoutError,
    DataPlaneClient,
    DataPlaneClosedError,
    FieldBatch,
    FieldNotWrittenError,
    FieldValue,
    KVBatchMeta,
    MissingKeysError,
    SchemaMismatchError,
    UnknownFieldError,
    UnknownPartitionError,
    UnknownTaskError,
    format_keys,
    resolve_fields,
)


@dataclass
class _Segment:
    """One put's packed data for one field; immutable once stored."""

    values: torch.Tensor  # [T, *trailing] jagged, [n, *trailing] dense
    offsets: torch.Tensor | None  # [n + 1] int64, jagged only
    lengths: torch.Tensor | None  # [n] int64, jagged only
    live: int
    nbytes: int


@dataclass
class _FieldStore:
    jagged: bool
    dtype: torch.dtype
    trailing: tuple[int, ...]
    loc_seg: torch.Tensor  # [row capacity] int64, -1 = not written
    loc_pos: torch.Tensor  # [row capacity] int64
    segments: dict[int, _Segment] = field(default_factory=dict)
    next_seg: int = 0

    def describe(self) -> str:
        return f"{'jagged' if self.jagged else 'dense'} {self.dtype} trailing shape {self.trailing}"


@dataclass
class _Partition:
    fields: list[str]
    num_samples: int
    consumer_tasks: list[str]
    grpo_group_size: int | None
    rows: dict[str, int] = field(default_factory=dict)  # key -> row id, in first-put order
    next_row: int = 0
    row_capacity: int = 0
    columns: dict[str, _FieldStore] = field(default_factory=dict)
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)
    consumed: dict[str, set[str]] = field(default_factory=dict)


def _store_copy(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous CPU copy (exactly one copy; never a cast)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu").contiguous()
    return t.clone(memory_format=torch.contiguous_format)


def _gather_segment(
    seg: _Segment, pos: torch.Tensor, cache: dict[int, tuple[slice | torch.Tensor, torch.Tensor]] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows `pos` of one segment as (values, lengths): one slice (consecutive rows) or one index_select.

    `cache` (one get, all requested rows in this segment) maps a shared offsets tensor to its token selection,
    so fields written by the same put build it once: such fields hold the same rows at the same positions.
    """
    p = pos.tolist()
    n = len(p)
    run = n > 0 and p[-1] - p[0] == n - 1 and p == list(range(p[0], p[0] + n))
    if seg.offsets is None or seg.lengths is None:
        if run:
            return seg.values[p[0] : p[0] + n].clone(), None
        return seg.values.index_select(0, pos), None
    hit = None if cache is None else cache.get(id(seg.offsets))
    if hit is None:
        if run:
            start, stop = int(seg.offsets[p[0]]), int(seg.offsets[p[-1] + 1])
            hit = (slice(start, stop), seg.lengths[p[0] : p[0] + n].clone())
        else:
            lens = seg.lengths.index_select(0, pos)  # [n]
            hit = (flat_token_index(seg.offsets.index_select(0, pos), lens), lens)  # [T], [n]
        if cache is not None:
            cache[id(seg.offsets)] = hit
    where, lens = hit
    values = seg.values[where].clone() if isinstance(where, slice) else seg.values.index_select(0, where)
    return values, lens


class ColumnarStore:
    """Thread-safe columnar sample store implementing the DataPlaneClient semantics (see interfaces.py)."""

    def __init__(self, storage_capacity: int = 1_000_000):
        if storage_capacity < 1:
            raise ValueError(f"storage_capacity must be >= 1, got {storage_capacity}")
        self.storage_capacity = storage_capacity
        self._parts: dict[str, _Partition] = {}
        self._live = 0
        self._closed = False
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)

    # ------------------------------------------------------------------ helpers
    def _part(self, partition_id: str) -> _Partition:
        if self._closed:
            raise DataPlaneClosedError("the data plane store is closed")
        part = self._parts.get(partition_id)
        if part is None:
            known = sorted(self._parts)
            raise UnknownPartitionError(f"partition {partition_id!r} is not registered (registered: {known})")
        return part

    @staticmethod
    def _check_declared(part: _Partition, partition_id: str, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in part.fields]
        if unknown:
            raise UnknownFieldError(
                f"field(s) {unknown} not declared for partition {partition_id!r} (declared: {part.fields})"
            )

    @staticmethod
    def _grow_rows(part: _Partition, needed: int) -> None:
        if needed <= part.row_capacity:
            return
        cap = max(needed, 2 * part.row_capacity, 1024)
        for fs in part.columns.values():
            for name in ("loc_seg", "loc_pos"):
                old = getattr(fs, name)
                new = torch.full((cap,), -1, dtype=torch.int64)
                new[: old.shape[0]] = old
                setattr(fs, name, new)
        part.row_capacity = cap

    @staticmethod
    def _release(fs: _FieldStore, rows: torch.Tensor) -> None:
        """Forget where `rows` live in `fs`; free segments with no live rows left."""
        live_before = Counter(s for s in fs.loc_seg.index_select(0, rows).tolist() if s >= 0)
        for s, c in live_before.items():
            seg = fs.segments[s]
            seg.live -= c
            if seg.live <= 0:
                del fs.segments[s]
        fs.loc_seg.index_fill_(0, rows, -1)

    @staticmethod
    def _empty(part: _Partition) -> None:
        """Drop every sample of a partition; its declaration and field schemas (first-write dtypes) stay."""
        part.rows.clear()
        part.tags.clear()
        for consumed in part.consumed.values():
            consumed.clear()
        for fs in part.columns.values():
            fs.loc_seg = fs.loc_pos = torch.empty(0, dtype=torch.int64)
            fs.segments.clear()
        part.next_row = part.row_capacity = 0

    # ------------------------------------------------------------------ task-mediated API
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
            if old is not None and old.rows:
                raise ValueError(
                    f"partition {partition_id!r} still holds {len(old.rows)} samples; "
                    "clear_samples(None, partition_id) before re-registering it"
                )
            tasks = list(dict.fromkeys(consumer_tasks))
            self._parts[partition_id] = _Partition(
                fields=list(dict.fromkeys(fields)),
                num_samples=num_samples,
                consumer_tasks=tasks,
                grpo_group_size=grpo_group_size,
                consumed={t: set() for t in tasks},
            )
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
                        f"task {task_name!r} is not a consumer task of partition {partition_id!r} "
                        f"(tasks: {part.consumer_tasks})"
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
    def _ready_keys(part: _Partition, consumed: set[str], required: Sequence[str], limit: int) -> list[str]:
        cand = [k for k in part.rows if k not in consumed]
        if not cand or not required:
            return cand[:limit]
        rows = torch.tensor([part.rows[k] for k in cand], dtype=torch.int64)
        ok = torch.ones(len(cand), dtype=torch.bool)
        for name in required:
            fs = part.columns.get(name)
            if fs is None:
                return []
            ok &= fs.loc_seg.index_select(0, rows) >= 0
        picked = ok.nonzero().squeeze(1)[:limit].tolist()
        return [cand[i] for i in picked]

    def _claimed_meta(
        self, part: _Partition, partition_id: str, task: str, required: Sequence[str], keys: list[str]
    ) -> KVBatchMeta:
        lens: list[int] | None = None
        jagged = [n for n in required if part.columns[n].jagged] if keys else []
        if jagged:
            fs = part.columns[jagged[0]]
            rows = torch.tensor([part.rows[k] for k in keys], dtype=torch.int64)
            seg_ids, pos = fs.loc_seg.index_select(0, rows).tolist(), fs.loc_pos.index_select(0, rows).tolist()
            lens = [int(fs.segments[s].lengths[p]) for s, p in zip(seg_ids, pos)]  # type: ignore[index]
        tags = [dict(part.tags.get(k, {})) for k in keys] if any(k in part.tags for k in keys) else None
        return KVBatchMeta(partition_id, list(keys), list(required), lens, tags, {}, task)

    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> FieldBatch:
        return self.get_samples(meta.keys, meta.partition_id, resolve_fields(meta, select_fields))

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        with self._lock:
            part = self._part(partition_id)
            for task in task_names:
                if task not in part.consumed:
                    raise UnknownTaskError(f"task {task!r} is not a consumer task of partition {partition_id!r}")
                if any(k not in part.consumed[task] for k in part.rows):
                    return False
            return True

    # ------------------------------------------------------------------ direct by key
    def put_samples(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Mapping[str, FieldValue],
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        n = len(keys)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"put_samples: keys must be strings, got {sorted({type(k).__name__ for k in keys})}")
        if len(set(keys)) != n:
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"put_samples: duplicate keys {format_keys(dup)}")
        if tags is not None and len(tags) != n:
            raise ValueError(f"put_samples: tags ({len(tags)}) must align 1:1 with keys ({n})")
        cols = {name: as_column(name, v) for name, v in fields.items()}
        for name, col in cols.items():
            if col.num_rows != n:
                raise ValueError(f"put_samples: field '{name}' has {col.num_rows} rows for {n} keys")
        # Copy outside the lock (the only bulk work of a put), then validate and publish atomically.
        staged: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        copies: dict[int, torch.Tensor] = {}  # fields given the same lengths share one copy (and one offsets)
        for name, c in cols.items():
            lengths = c.lengths
            if lengths is not None:
                same = copies.get(id(lengths))
                if same is None:
                    same = next((t for t in copies.values() if torch.equal(t, lengths)), None)
                if same is None:
                    same = lengths.to("cpu", torch.int64).clone()
                copies[id(lengths)] = same
                lengths = same
            staged[name] = (_store_copy(c.values), lengths)
        with self._lock:
            part = self._part(partition_id)
            self._check_declared(part, partition_id, list(cols))
            for name, col in cols.items():
                fs = part.columns.get(name)
                if fs is not None and (fs.jagged, fs.dtype, fs.trailing) != (
                    col.is_jagged,
                    col.dtype,
                    col.trailing_shape,
                ):
                    got = f"{'jagged' if col.is_jagged else 'dense'} {col.dtype} trailing shape {col.trailing_shape}"
                    raise SchemaMismatchError(
                        f"field '{name}' of partition {partition_id!r} was first written as {fs.describe()}; "
                        f"this write is {got} (the data plane never casts)"
                    )
            new_keys = [k for k in keys if k not in part.rows]
            if self._live + len(new_keys) > self.storage_capacity:
                raise CapacityExceededError(
                    f"put of {len(new_keys)} new samples to {partition_id!r} would hold {self._live + len(new_keys)} "
                    f"samples, above data_plane.storage_capacity={self.storage_capacity}; clear consumed samples "
                    "or raise the capacity"
                )
            if n:
                self._commit(part, keys, new_keys, cols, staged)
            if tags is not None:
                for k, t in zip(keys, tags):
                    part.tags.setdefault(k, {}).update(t)
            self._changed.notify_all()
        return KVBatchMeta(
            partition_id, keys, list(cols), None, None if tags is None else [dict(t) for t in tags], {}, None
        )

    def _commit(
        self,
        part: _Partition,
        keys: list[str],
        new_keys: list[str],
        cols: dict[str, Column],
        staged: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    ) -> None:
        first_new = part.next_row
        self._grow_rows(part, first_new + len(new_keys))
        part.rows.update(zip(new_keys, range(first_new, first_new + len(new_keys))))
        part.next_row += len(new_keys)
        self._live += len(new_keys)
        if len(new_keys) == len(keys):  # the common first write: rows are one fresh range
            rows = torch.arange(first_new, first_new + len(keys), dtype=torch.int64)  # [n]
        else:
            rows = torch.tensor([part.rows[k] for k in keys], dtype=torch.int64)  # [n]
        positions = torch.arange(len(keys), dtype=torch.int64)
        offsets_of: dict[int, torch.Tensor] = {}
        for name, (values, lengths) in staged.items():
            fs = part.columns.get(name)
            if fs is None:
                col = cols[name]
                empty = torch.full((part.row_capacity,), -1, dtype=torch.int64)
                fs = _FieldStore(col.is_jagged, col.dtype, col.trailing_shape, empty, empty.clone())
                part.columns[name] = fs
            else:
                self._release(fs, rows)
            offsets = None
            if lengths is not None:
                offsets = offsets_of.get(id(lengths))
                if offsets is None:
                    offsets = offsets_of[id(lengths)] = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
                    torch.cumsum(lengths, 0, out=offsets[1:])
            nbytes = values.numel() * values.element_size() + (0 if offsets is None else 16 * lengths.numel())  # type: ignore[union-attr]
            fs.segments[fs.next_seg] = _Segment(values, offsets, lengths, len(keys), nbytes)
            fs.loc_seg.index_fill_(0, rows, fs.next_seg)
            fs.loc_pos.index_copy_(0, rows, positions)
            fs.next_seg += 1

    def get_samples(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> FieldBatch:
        if isinstance(select_fields, str):
            raise TypeError("select_fields must be a sequence of field names, not a single string")
        keys = list(keys)
        names = list(dict.fromkeys(select_fields))
        with self._lock:
            part = self._part(partition_id)
            self._check_declared(part, partition_id, names)
            row_list = [part.rows.get(k, -1) for k in keys]
            missing = [k for k, r in zip(keys, row_list) if r < 0]
            if missing:
                raise MissingKeysError(
                    f"{len(missing)} key(s) not in partition {partition_id!r}: {format_keys(missing)}", missing
                )
            rows = torch.tensor(row_list, dtype=torch.int64)  # [n]
            plan = []
            for name in names:
                fs = part.columns.get(name)
                if fs is None:
                    raise FieldNotWrittenError(
                        f"field '{name}' has not been written in partition {partition_id!r}", list(keys)
                    )
                seg_ids = fs.loc_seg.index_select(0, rows)  # [n]
                seg_list = seg_ids.tolist()
                if keys and min(seg_list) < 0:
                    lacking = [k for k, s in zip(keys, seg_list) if s < 0]
                    raise FieldNotWrittenError(
                        f"field '{name}' not yet written for {len(lacking)} key(s) of partition {partition_id!r}: "
                        f"{format_keys(lacking)}",
                        lacking,
                    )
                # Segments are immutable: keep references, gather outside the lock.
                plan.append((name, fs, seg_ids, seg_list, fs.loc_pos.index_select(0, rows), dict(fs.segments)))
        cache: dict[int, tuple[slice | torch.Tensor, torch.Tensor]] = {}
        return {name: self._gather(fs, ids, lst, pos, segs, cache) for name, fs, ids, lst, pos, segs in plan}

    @staticmethod
    def _gather(
        fs: _FieldStore,
        seg_ids: torch.Tensor,
        seg_list: list[int],
        pos: torch.Tensor,
        segs: dict[int, _Segment],
        cache: dict[int, tuple[slice | torch.Tensor, torch.Tensor]],
    ) -> Column:
        n = len(seg_list)
        if n == 0:
            empty = torch.empty((0, *fs.trailing), dtype=fs.dtype)
            return Column.unchecked(empty, torch.zeros(0, dtype=torch.int64) if fs.jagged else None)
        if seg_list.count(seg_list[0]) == n:
            return Column.unchecked(*_gather_segment(segs[seg_list[0]], pos, cache))
        # Rows spread over several segments: gather each segment's rows, scatter into place.
        groups = [(s, (seg_ids == s).nonzero().squeeze(1)) for s in sorted(set(seg_list))]
        if not fs.jagged:
            out = torch.empty((n, *fs.trailing), dtype=fs.dtype)
            for s, sel in groups:
                out.index_copy_(0, sel, _gather_segment(segs[s], pos.index_select(0, sel))[0])
            return Column.unchecked(out)
        lens = torch.empty(n, dtype=torch.int64)
        for s, sel in groups:
            lens.index_copy_(0, sel, segs[s].lengths.index_select(0, pos.index_select(0, sel)))  # type: ignore[union-attr]
        out_starts = torch.cumsum(lens, 0) - lens  # [n]
        out = torch.empty((int(lens.sum()), *fs.trailing), dtype=fs.dtype)
        for s, sel in groups:
            values, sub_lens = _gather_segment(segs[s], pos.index_select(0, sel))
            assert sub_lens is not None
            out.index_copy_(0, flat_token_index(out_starts.index_select(0, sel), sub_lens), values)
        return Column.unchecked(out, lens)

    def clear_samples(self, keys: Sequence[str] | None, partition_id: str) -> int:
        with self._lock:
            part = self._part(partition_id)
            if keys is None:  # everything: reset instead of releasing row by row
                count = len(part.rows)
                self._empty(part)
                self._live -= count
                self._changed.notify_all()
                return count
            if isinstance(keys, str):
                raise TypeError("clear_samples takes a sequence of keys (or None), not a single string")
            gone = [k for k in dict.fromkeys(keys) if k in part.rows]
            if not gone:
                return 0
            rows = torch.tensor([part.rows.pop(k) for k in gone], dtype=torch.int64)
            for fs in part.columns.values():
                self._release(fs, rows)
            for k in gone:
                part.tags.pop(k, None)
                for consumed in part.consumed.values():
                    consumed.discard(k)
            self._live -= len(gone)
            if not part.rows:  # reset row ids so a long-lived partition's index arrays do not grow forever
                self._empty(part)
            self._changed.notify_all()
            return len(gone)

    # ------------------------------------------------------------------ lifecycle and introspection
    def close(self) -> None:
        with self._lock:
            self._parts.clear()
            self._live = 0
            self._closed = True
            self._changed.notify_all()

    def bytes_held(self) -> dict[str, int]:
        with self._lock:
            return {
                pid: sum(s.nbytes for fs in part.columns.values() for s in fs.segments.values())
                for pid, part in self._parts.items()
            }

    def keys(self, partition_id: str) -> list[str]:
        """Live keys of a partition in first-put order."""
        with self._lock:
            return list(self._part(partition_id).rows)

    def num_samples_held(self) -> int:
        with self._lock:
            return self._live


class MemoryDataPlaneClient(DataPlaneClient):
    """DataPlaneClient over a `ColumnarStore` living in this process."""

    def __init__(self, store: ColumnarStore, *, owns_store: bool = True):
        self.store = store
        self._owns_store = owns_store
        self._closed = False

    def _s(self) -> ColumnarStore:
        if self._closed:
            raise DataPlaneClosedError("this data plane client is closed")
        return self.store

    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int,
        consumer_tasks: Sequence[str],
        grpo_group_size: int | None = None,
    ) -> None:
        self._s().register_partition(partition_id, fields, num_samples, consumer_tasks, grpo_group_size)

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
        return self._s().claim_meta(partition_id, task_name, required_fields, batch_size, dp_rank, blocking, timeout_s)

    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> FieldBatch:
        return self._s().get_data(meta, select_fields)

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        return self._s().check_consumption_status(partition_id, task_names)

    def put_samples(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Mapping[str, FieldValue],
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return self._s().put_samples(keys, partition_id, fields, tags)

    def get_samples(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> FieldBatch:
        return self._s().get_samples(keys, partition_id, select_fields)

    def clear_samples(self, keys: Sequence[str] | None, partition_id: str) -> int:
        return self._s().clear_samples(keys, partition_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_store:
            self.store.close()

    def bytes_held(self) -> dict[str, int]:
        return {} if self._closed else self.store.bytes_held()

    def keys(self, partition_id: str) -> list[str]:
        return self._s().keys(partition_id)


_process_store: ColumnarStore | None = None
_process_lock = threading.Lock()


def build_client(cfg: DataPlaneConfig, *, bootstrap: bool) -> MemoryDataPlaneClient:
    """Driver (`bootstrap=True`): create this process's store. Others: attach to it (same process only)."""
    global _process_store
    with _process_lock:
        if bootstrap:
            _process_store = ColumnarStore(cfg.storage_capacity)
            return MemoryDataPlaneClient(_process_store, owns_store=True)
        if _process_store is None or _process_store._closed:
            raise RuntimeError(
                "no memory data plane store in this process: the memory backend only serves workers living in "
                "the driver process; build it with bootstrap=True first, or use data_plane.backend='ray'"
            )
        return MemoryDataPlaneClient(_process_store, owns_store=False)

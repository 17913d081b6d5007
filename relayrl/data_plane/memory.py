"""The embedded `memory` backend: a columnar, in-process, thread-safe store.

`ColumnarStore` is the shared `Ledger` (keys, schemas, written fields, tags, cursors, capacity) plus the tensors.
Layout (where the speed comes from): each put stores, per field, ONE segment (a packed `values` tensor plus
`offsets`/`lengths` for jagged fields) and records where every row landed in two int64 arrays per field
(`loc_seg`, `loc_pos`, indexed by the ledger's row id). There is never one Python object per sample for tensor
data. A get gathers per field with one slice (contiguous rows) or one `index_select` over a flat token index per
segment. A write-back adds a segment without touching existing ones. A segment is freed when its last live row is
cleared or overwritten.

The `ray` backend hosts a `ColumnarStore` in an actor; `MemoryDataPlaneClient` reaches one in this process.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column, FieldSpec, flat_token_index
from relayrl.data_plane.interfaces import (
    DataPlaneClient,
    FieldBatch,
    FieldValue,
    KVBatchMeta,
    Tags,
    check_put,
    put_receipt,
)
from relayrl.data_plane.ledger import Ledger
from relayrl.data_plane.proxy import ProxyClient

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

_TokenSelection = tuple[slice | torch.Tensor, torch.Tensor]
"""Where one segment's requested rows lie in its flat values (a slice or a `[T]` index) and their lengths `[n]`."""


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
    """Where each row of one field lives: segment id and position in it (the ledger's row ids index both)."""

    loc_seg: torch.Tensor  # [row capacity] int64, -1 = not written
    loc_pos: torch.Tensor  # [row capacity] int64
    segments: dict[int, _Segment] = field(default_factory=dict)
    next_seg: int = 0

    def fit(self, capacity: int) -> None:
        """Grow the row arrays to the ledger's row capacity."""
        for name in ("loc_seg", "loc_pos"):
            old = getattr(self, name)
            if old.shape[0] < capacity:
                setattr(self, name, torch.cat([old, torch.full((capacity - old.shape[0],), -1, dtype=torch.int64)]))

    def release(self, rows: torch.Tensor) -> None:
        """Forget where `rows` [n] live; free segments with no live rows left."""
        live_before = Counter(s for s in self.loc_seg.index_select(0, rows).tolist() if s >= 0)
        for s, c in live_before.items():
            seg = self.segments[s]
            seg.live -= c
            if seg.live <= 0:
                del self.segments[s]
        self.loc_seg.index_fill_(0, rows, -1)


def _store_copy(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous CPU copy (exactly one copy; never a cast)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu").contiguous()
    return t.clone(memory_format=torch.contiguous_format)


def _gather_segment(
    seg: _Segment, pos: torch.Tensor, cache: dict[int, _TokenSelection] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows `pos` [n] of one segment as (values, lengths): one slice (consecutive rows) or one index_select.

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


def _gather(
    spec: FieldSpec,
    seg_ids: torch.Tensor,
    pos: torch.Tensor,
    segs: dict[int, _Segment],
    cache: dict[int, _TokenSelection],
) -> Column:
    """One field's requested rows (segment ids and positions `[n]`) as a Column in request order."""
    seg_list = seg_ids.tolist()
    n = len(seg_list)
    if n == 0:
        empty = torch.empty((0, *spec.trailing), dtype=spec.torch_dtype)
        return Column.unchecked(empty, torch.zeros(0, dtype=torch.int64) if spec.jagged else None)
    if seg_list.count(seg_list[0]) == n:
        return Column.unchecked(*_gather_segment(segs[seg_list[0]], pos, cache))
    # Rows spread over several segments: gather each segment's rows, scatter into place.
    groups = [(s, (seg_ids == s).nonzero().squeeze(1)) for s in sorted(set(seg_list))]
    if not spec.jagged:
        out = torch.empty((n, *spec.trailing), dtype=spec.torch_dtype)
        for s, sel in groups:
            out.index_copy_(0, sel, _gather_segment(segs[s], pos.index_select(0, sel))[0])
        return Column.unchecked(out)
    lens = torch.empty(n, dtype=torch.int64)  # [n]
    for s, sel in groups:
        lens.index_copy_(0, sel, segs[s].lengths.index_select(0, pos.index_select(0, sel)))  # type: ignore[union-attr]
    out_starts = torch.cumsum(lens, 0) - lens  # [n]
    out = torch.empty((int(lens.sum()), *spec.trailing), dtype=spec.torch_dtype)
    for s, sel in groups:
        values, sub_lens = _gather_segment(segs[s], pos.index_select(0, sel))
        assert sub_lens is not None
        out.index_copy_(0, flat_token_index(out_starts.index_select(0, sel), sub_lens), values)
    return Column.unchecked(out, lens)


class ColumnarStore(Ledger, DataPlaneClient):
    """The ledger plus packed tensor segments: a complete, thread-safe, in-process `DataPlaneClient`."""

    def __init__(self, storage_capacity: int = 1_000_000):
        super().__init__(storage_capacity)
        self._columns: dict[str, dict[str, _FieldStore]] = {}  # partition -> field -> where its rows live

    def _forget(self, partition_id: str, rows: torch.Tensor | None) -> None:
        if rows is None:
            self._columns.pop(partition_id, None)
            return
        for fs in self._columns.get(partition_id, {}).values():
            fs.release(rows)

    def put_samples(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Mapping[str, FieldValue],
        tags: Sequence[Mapping[str, Any]] | None = None,
        checksums: Mapping[str, torch.Tensor] | None = None,
    ) -> KVBatchMeta:
        """A put; `checksums` (`[n]` per field, see checksum.py) are recorded for the getter to verify."""
        key_list, cols = check_put(keys, fields, tags)
        tag_list = None if tags is None else [dict(t) for t in tags]
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
            self._reserve(part, partition_id, key_list, {name: FieldSpec.of(c) for name, c in cols.items()})
            marks = {name: lens for name, (_, lens) in staged.items()}
            rows = self._publish(part, key_list, marks, tag_list, checksums)
            if key_list:
                self._store(self._columns.setdefault(partition_id, {}), part.row_capacity, rows, staged)
            self._changed.notify_all()
        return put_receipt(partition_id, key_list, list(cols), tag_list)

    @staticmethod
    def _store(
        columns: dict[str, _FieldStore],
        capacity: int,
        rows: torch.Tensor,
        staged: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    ) -> None:
        """One new segment per field for the put's rows `[n]`; the rows' old segments lose them."""
        for fs in columns.values():
            fs.fit(capacity)
        positions = torch.arange(rows.shape[0], dtype=torch.int64)  # [n]
        offsets_of: dict[int, torch.Tensor] = {}
        for name, (values, lengths) in staged.items():
            if name in columns:
                fs = columns[name]
                fs.release(rows)
            else:
                empty = torch.full((capacity,), -1, dtype=torch.int64)
                fs = columns[name] = _FieldStore(empty, empty.clone())
            offsets = None
            nbytes = values.numel() * values.element_size()
            if lengths is not None:
                offsets = offsets_of.get(id(lengths))
                if offsets is None:
                    offsets = offsets_of[id(lengths)] = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
                    torch.cumsum(lengths, 0, out=offsets[1:])
                nbytes += 16 * lengths.numel()
            fs.segments[fs.next_seg] = _Segment(values, offsets, lengths, rows.shape[0], nbytes)
            fs.loc_seg.index_fill_(0, rows, fs.next_seg)
            fs.loc_pos.index_copy_(0, rows, positions)
            fs.next_seg += 1

    def get_samples(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> FieldBatch:
        return self._gather_rows(keys, partition_id, select_fields, None)

    def get_samples_checked(
        self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> tuple[FieldBatch, dict[str, torch.Tensor]]:
        """`get_samples` plus each field's checksums recorded at put (`[n]`, -1 where none), read atomically."""
        checksums: dict[str, torch.Tensor] = {}
        return self._gather_rows(keys, partition_id, select_fields, checksums), checksums

    def _gather_rows(
        self,
        keys: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str],
        checksums: dict[str, torch.Tensor] | None,
    ) -> FieldBatch:
        if isinstance(select_fields, str):
            raise TypeError("select_fields must be a sequence of field names, not a single string")
        keys = list(keys)
        names = list(dict.fromkeys(select_fields))
        with self._lock:
            part = self._part(partition_id)
            rows = self._rows_for_get(part, partition_id, keys, names)  # [n]
            if checksums is not None:
                checksums.update(part.checksums_of(rows, names))
            columns = self._columns.get(partition_id, {})
            plan: list[tuple[str, FieldSpec, torch.Tensor, torch.Tensor, dict[int, _Segment]]] = []
            for name in names:
                fs = columns.get(name)
                if fs is None:  # written by empty puts only, so no key can be asked for
                    plan.append((name, part.schema[name], rows, rows, {}))
                    continue
                # Segments are immutable: keep references, gather outside the lock.
                seg_ids, pos = fs.loc_seg.index_select(0, rows), fs.loc_pos.index_select(0, rows)  # [n], [n]
                plan.append((name, part.schema[name], seg_ids, pos, dict(fs.segments)))
        cache: dict[int, _TokenSelection] = {}
        return {name: _gather(spec, ids, pos, segs, cache) for name, spec, ids, pos, segs in plan}

    def bytes_held(self) -> dict[str, int]:
        """Bytes of every live segment (a segment stays whole until its last live row goes)."""
        with self._lock:
            return {
                pid: sum(s.nbytes for fs in self._columns.get(pid, {}).values() for s in fs.segments.values())
                for pid in self._parts
            }


class MemoryDataPlaneClient(ProxyClient):
    """A client of a `ColumnarStore` in this process; closing an attached client leaves the store open."""

    def __init__(self, store: ColumnarStore, *, owns_store: bool = True, verify_checksums: bool = True):
        super().__init__(verify_checksums=verify_checksums)
        self.store = store
        self._owns_store = owns_store

    def _call_within(
        self, timeout_s: float, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        self._check_open()
        bound: Callable[P, R] = getattr(self.store, method.__name__)  # the store's own override runs
        return bound(*args, **kwargs)

    def _put(
        self,
        keys: list[str],
        partition_id: str,
        cols: dict[str, Column],
        tags: list[Tags] | None,
        checksums: dict[str, torch.Tensor] | None,
    ) -> KVBatchMeta:
        return self._call(ColumnarStore.put_samples, keys, partition_id, cols, tags, checksums)

    def _get(self, keys: list[str], partition_id: str, names: list[str]) -> FieldBatch:
        return self._call(ColumnarStore.get_samples, keys, partition_id, names)

    def _get_checked(
        self, keys: list[str], partition_id: str, names: list[str]
    ) -> tuple[FieldBatch, dict[str, torch.Tensor]]:
        return self._call(ColumnarStore.get_samples_checked, keys, partition_id, names)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_store:
            self.store.close()


_process_store: ColumnarStore | None = None
_process_lock = threading.Lock()


def build_client(cfg: DataPlaneConfig, *, bootstrap: bool) -> MemoryDataPlaneClient:
    """Driver (`bootstrap=True`): create this process's store. Others: attach to it (same process only)."""
    global _process_store
    with _process_lock:
        if bootstrap:
            _process_store = ColumnarStore(cfg.storage_capacity)
            return MemoryDataPlaneClient(_process_store, owns_store=True, verify_checksums=cfg.verify_checksums)
        if _process_store is None or _process_store.closed:
            raise RuntimeError(
                "no memory data plane store in this process: the memory backend only serves workers living in "
                "the driver process; build it with bootstrap=True first, or use data_plane.backend='ray'"
            )
        return MemoryDataPlaneClient(_process_store, owns_store=False, verify_checksums=cfg.verify_checksums)

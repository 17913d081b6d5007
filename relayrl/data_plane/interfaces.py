"""The data-plane boundary: `KVBatchMeta` (the small handle that crosses the driver), the `DataPlaneClient`
contract every backend implements, and the errors that make the contract strict.

Vocabulary: a *partition* is a named scope ("train", "val"); a *key* addresses one sample and is minted once at
rollout (`f"{uid}_g{i}"`); a *field* is a named column; a *task* is a consumer with its own cursor. Bulk tensors
live in the store as `Column`s (see codec.py); only metadata and per-row scalars travel through the driver.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relayrl.data_plane.codec import Column, as_column
from relayrl.utils.deadlines import DeadlineError

FieldValue = Column | torch.Tensor
"""What a put accepts per field: a Column, a plain tensor (dense, row i = t[i]) or a jagged nested tensor."""

FieldBatch = dict[str, Column]
"""What a get returns: one Column per selected field, rows in the requested key order."""

Tags = dict[str, Any]
"""One sample's tags: primitive values by name (the same dicts `KVBatchMeta.tags` carries)."""


# ---------------------------------------------------------------------------------------------------- errors
class DataPlaneError(Exception):
    """Base of every error the data plane raises on purpose."""


class _KeyLikeError(DataPlaneError, KeyError):
    """KeyError whose str() is the plain message (KeyError would repr() it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownPartitionError(_KeyLikeError):
    """The partition was never registered (or was closed)."""


class _NamesKeysError(_KeyLikeError):
    """A key error that lists the keys at fault in `.missing`."""

    def __init__(self, message: str, missing: Sequence[str]):
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across Ray processes despite the extra argument
        return (type(self), (self.args[0], self.missing))


class MissingKeysError(_NamesKeysError):
    """Some requested keys are not in the partition; `.missing` lists them."""


class UnknownFieldError(_KeyLikeError):
    """The field was not declared when the partition was registered."""


class FieldNotWrittenError(_NamesKeysError):
    """The field is declared but has not been written for some requested keys; `.missing` lists them."""


class UnknownTaskError(_KeyLikeError):
    """The consumer task was not registered for the partition."""


class SchemaMismatchError(DataPlaneError, TypeError):
    """A write's dtype, layout or trailing shape differs from the field's first write (never cast)."""


class CapacityExceededError(DataPlaneError, RuntimeError):
    """A put would hold more samples than `storage_capacity` allows."""


class ChecksumMismatchError(DataPlaneError):
    """A fetched row differs from what was put (`data_plane.verify_checksums`); names the key and the field."""

    def __init__(self, message: str, key: str = "", field: str = ""):
        super().__init__(message)
        self.key, self.field = key, field

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across Ray processes despite the extra arguments
        return (type(self), (self.args[0], self.key, self.field))


class DataPlaneClosedError(DataPlaneError, RuntimeError):
    """The client (or its store) was closed."""


class ClaimTimeoutError(DataPlaneError, DeadlineError):
    """A blocking call did not complete within its timeout (a `DeadlineError`: the CLI ends the run in one line)."""


def format_keys(keys: Sequence[str], limit: int = 8) -> str:
    """Short printable list of keys for error messages."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    more = f", ... ({len(keys)} total)" if len(keys) > limit else ""
    return f"[{shown}{more}]"


# ---------------------------------------------------------------------------------------------------- KVBatchMeta
def _meta_from_wire(
    partition_id: str,
    packed: tuple[Any, Any, Any],
    fields: list[str] | None,
    extra_info: dict[str, Any],
    task_name: str | None,
) -> KVBatchMeta:
    from relayrl.data_plane import meta_wire as w

    keys, lengths, tags = packed
    return KVBatchMeta(
        partition_id,
        w.unpack_keys(keys),
        fields,
        w.unpack_lengths(lengths),
        w.unpack_tags(tags),
        extra_info,
        task_name,
    )


@dataclass
class KVBatchMeta:
    """Handle for a batch of samples in one partition; pure metadata, picklable, cheap to ship over Ray.

    `fields`: on a put receipt, the fields that put wrote; on a dispatch meta, the fields the consumer fetches.
    `sequence_lengths` and `tags` (per-row primitive dicts) move in lockstep with `keys` in every transform.
    """

    partition_id: str
    keys: list[str]
    fields: list[str] | None = None
    sequence_lengths: list[int] | None = None
    tags: list[dict[str, Any]] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    task_name: str | None = None

    def __post_init__(self) -> None:
        if self.tags is not None and len(self.tags) != len(self.keys):
            raise ValueError(f"tags ({len(self.tags)}) must align 1:1 with keys ({len(self.keys)})")
        if self.sequence_lengths is not None and len(self.sequence_lengths) != len(self.keys):
            raise ValueError(
                f"sequence_lengths ({len(self.sequence_lengths)}) must align 1:1 with keys ({len(self.keys)})"
            )

    @property
    def size(self) -> int:
        return len(self.keys)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle small (see meta_wire.py): the handle crosses the driver and Ray on every dispatch."""
        from relayrl.data_plane import meta_wire as w

        packed = (w.pack_keys(self.keys), w.pack_lengths(self.sequence_lengths), w.pack_tags(self.tags))
        return (_meta_from_wire, (self.partition_id, packed, self.fields, self.extra_info, self.task_name))

    # ------------------------------------------------------------------ transforms (metadata only, no I/O)
    def stamp_tags(self, scalars: Mapping[str, Sequence[Any]]) -> None:
        """In place: set `tags[i][name] = values[i]` for every (name, values); lengths must equal `size`."""
        for name, values in scalars.items():
            if len(values) != self.size:
                raise ValueError(f"stamp_tags: '{name}' has {len(values)} values, expected {self.size}")
        if self.tags is None:
            self.tags = [{} for _ in range(self.size)]
        for name, values in scalars.items():
            for tag, value in zip(self.tags, values):
                tag[name] = value

    def subset(self, indices: Iterable[int]) -> KVBatchMeta:
        """Rows at `indices` in that order (repeats allowed)."""
        idx = list(indices)
        return self._replace(
            [self.keys[i] for i in idx],
            None if self.sequence_lengths is None else [self.sequence_lengths[i] for i in idx],
            None if self.tags is None else [self.tags[i] for i in idx],
        )

    def slice(self, start: int, stop: int) -> KVBatchMeta:
        """Contiguous rows `[start, stop)` with Python slice semantics."""
        return self._replace(
            self.keys[start:stop],
            None if self.sequence_lengths is None else self.sequence_lengths[start:stop],
            None if self.tags is None else self.tags[start:stop],
        )

    def concat(self, *others: KVBatchMeta) -> KVBatchMeta:
        """Self's rows then each other's; partitions must match. Lengths/tags kept only if every meta has them."""
        metas = (self, *others)
        for m in others:
            if m.partition_id != self.partition_id:
                raise ValueError(f"concat: partition_ids must match ({self.partition_id!r} vs {m.partition_id!r})")
        lens = None
        if all(m.sequence_lengths is not None for m in metas):
            lens = [n for m in metas for n in (m.sequence_lengths or [])]
        tags = None
        if all(m.tags is not None for m in metas):
            tags = [t for m in metas for t in (m.tags or [])]
        return self._replace([k for m in metas for k in m.keys], lens, tags)

    def drop(self, indices: Iterable[int]) -> KVBatchMeta | None:
        """Rows not in `indices`, original order; None when nothing remains. The caller clears the store."""
        gone = set(indices)
        keep = [i for i in range(self.size) if i not in gone]
        return self.subset(keep) if keep else None

    def with_fields(self, names: Iterable[str]) -> KVBatchMeta:
        """Fully independent copy whose `fields` = existing + `names`, de-duplicated, first occurrence wins."""
        merged = list(dict.fromkeys([*(self.fields or []), *names]))
        return KVBatchMeta(
            partition_id=self.partition_id,
            keys=list(self.keys),
            fields=merged,
            sequence_lengths=None if self.sequence_lengths is None else list(self.sequence_lengths),
            tags=None if self.tags is None else [dict(t) for t in self.tags],
            extra_info=copy.copy(self.extra_info),
            task_name=self.task_name,
        )

    def _replace(
        self, keys: list[str], sequence_lengths: list[int] | None, tags: list[dict[str, Any]] | None
    ) -> KVBatchMeta:
        return KVBatchMeta(
            partition_id=self.partition_id,
            keys=list(keys),
            fields=self.fields,
            sequence_lengths=None if sequence_lengths is None else list(sequence_lengths),
            tags=None if tags is None else list(tags),
            extra_info=dict(self.extra_info),
            task_name=self.task_name,
        )


# ---------------------------------------------------------------------------------------------------- client ABC
class DataPlaneClient(ABC):
    """Sample-keyed store contract. Every backend is strict and lossless:

    - a get of a missing key raises `MissingKeysError` (a KeyError) naming the keys; an undeclared field raises
      `UnknownFieldError`; a declared field not yet written for some key raises `FieldNotWrittenError`;
    - a write whose dtype, layout (jagged/dense) or trailing shape differs from the field's first write in the
      partition raises `SchemaMismatchError` (never casts); writing an existing (key, field) overwrites it;
    - a put is validated completely before anything changes, then becomes visible all at once;
    - `clear_samples` returns how many keys it removed; exceeding `storage_capacity` raises
      `CapacityExceededError`; every blocking call takes a timeout; clients are thread-safe.
    Results are copies: mutating what a get returns never changes the store.
    """

    # ------------------------------------------------------------------ task-mediated
    @abstractmethod
    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int,
        consumer_tasks: Sequence[str],
        grpo_group_size: int | None = None,
    ) -> None:
        """Declare a partition: every field any producer may write, expected sample count, consumer tasks.

        Re-registering an empty partition replaces its declaration; re-registering one that still holds samples
        raises ValueError (clear it first) so data is never dropped implicitly.
        """

    @abstractmethod
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
        """Claim up to `batch_size` samples whose `required_fields` are all written and `task_name` has not
        consumed yet, in put order; mark them consumed for that task. Blocking waits for a full batch (or the
        partition's last `num_samples` tail) and raises `ClaimTimeoutError` after `timeout_s`; non-blocking
        returns what is ready, possibly empty. `dp_rank` is reserved (sharding is done on the driver)."""

    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> FieldBatch:
        """`get_samples(meta.keys, meta.partition_id, select_fields or meta.fields)`; ValueError if neither."""
        return self.get_samples(meta.keys, meta.partition_id, resolve_fields(meta, select_fields))

    @abstractmethod
    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        """True iff every listed task has claimed every sample currently in the partition."""

    # ------------------------------------------------------------------ direct by key
    @abstractmethod
    def put_samples(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Mapping[str, FieldValue],
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Upsert `fields` for `keys` (row i ↔ key i); tags are merged into each key's tags. Returns a receipt
        meta with `fields` = the names written and `tags` = copies of the given tags (or None)."""

    @abstractmethod
    def get_samples(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> FieldBatch:
        """One Column per selected field with rows in `keys` order. No cursor moves."""

    @abstractmethod
    def clear_samples(self, keys: Sequence[str] | None, partition_id: str) -> int:
        """Remove `keys` (None: every key) from the partition; returns how many were present and removed.
        The partition stays registered."""

    @abstractmethod
    def drop_partition(self, partition_id: str) -> bool:
        """Forget an empty partition's declaration (per-batch partitions are retired this way after their step,
        so a long run neither keeps nor reports one per step). ValueError while it holds samples; returns False
        if it was not registered."""

    # ------------------------------------------------------------------ lifecycle and observability
    @abstractmethod
    def close(self) -> None:
        """Release handles; idempotent. Any later call raises `DataPlaneClosedError`."""

    def bytes_held(self) -> dict[str, int]:
        """Payload bytes currently held per partition (backends that can see their storage override this)."""
        return {}

    def keys(self, partition_id: str) -> list[str]:
        """Live keys of a partition in first-put order: what a leak check needs to name the leaked samples."""
        raise NotImplementedError(f"{type(self).__name__} cannot list the keys of a partition")

    def list_sample_ids(self, partition_id: str) -> list[str]:
        """The sample ids (keys) a partition holds, in first-put order; `UnknownPartitionError` for a partition
        that is not registered (an empty list would hide a typo in the id)."""
        return self.keys(partition_id)

    # ------------------------------------------------------------------ checkpoints (snapshot.py)
    def save_checkpoint(self, checkpoint_dir: str | Path, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Write every partition (declaration, rows with every field exact, tags, claim cursors) and `metadata`
        (JSON) to `checkpoint_dir`, atomically. Take it between steps: puts in flight are not included."""
        from relayrl.data_plane.snapshot import save_store

        save_store(self, Path(checkpoint_dir), dict(metadata or {}))

    def load_checkpoint(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote (its partitions must not hold samples here); returns its metadata."""
        from relayrl.data_plane.snapshot import load_store

        return load_store(self, Path(checkpoint_dir))

    def export_state(self) -> dict[str, dict[str, Any]]:
        """Every partition's bookkeeping as plain data (`ledger_state.PartitionState`); backends with a ledger."""
        raise NotImplementedError(f"{type(self).__name__} cannot export its partitions")

    def restore_state(self, partition_id: str, state: Mapping[str, Any]) -> None:
        """Recreate a registered, empty partition's keys, schemas, tags and cursors (`ledger_state`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore a partition")

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """`data_plane/*` counters for the trainer's logger (the metered wrapper overrides this); `reset=True`
        starts a new accumulation window after reading."""
        return {}


def resolve_fields(meta: KVBatchMeta, select_fields: Sequence[str] | None) -> list[str]:
    """Field resolution for `get_data`: explicit selection, else `meta.fields`, else ValueError (never fetch all)."""
    if select_fields is not None:
        return list(select_fields)
    if meta.fields is not None:
        return list(meta.fields)
    raise ValueError(
        f"get_data: meta for partition {meta.partition_id!r} has fields=None and no select_fields were given; "
        "name the fields to fetch"
    )


def check_put(
    keys: Sequence[str], fields: Mapping[str, FieldValue], tags: Sequence[Mapping[str, Any]] | None
) -> tuple[list[str], dict[str, Column]]:
    """A put's own consistency (string keys, no duplicates, aligned tags and rows), checked before any store sees it."""
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
    return keys, cols


def put_receipt(partition_id: str, keys: list[str], names: list[str], tags: Sequence[Tags] | None) -> KVBatchMeta:
    """What a put returns: the keys, the fields it wrote and copies of its tags."""
    return KVBatchMeta(partition_id, keys, names, None, None if tags is None else [dict(t) for t in tags], {}, None)

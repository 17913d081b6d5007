"""A ledger's bookkeeping as plain data, and back: what a data-plane checkpoint needs besides the tensors.

Why a separate mixin: the ledger is the one place that knows each partition's declaration, live keys (in first-put
order), field schemas, tags and per-task claim cursors, and on the Ray-hosted backends it lives in an actor, so the
checkpoint code (`snapshot.py`) asks it for that state by method name like any other ledger call. The tensors are
read and written through the ordinary `get_samples` / `put_samples`, so every backend checkpoints the same way.

`PartitionState` is plain data (lists, dicts, str, int, bool and the values of tags): it crosses Ray and is
written by `relayrl.utils.state_file` without pickling.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from relayrl.data_plane.codec import FieldSpec
from relayrl.data_plane.interfaces import CapacityExceededError, DataPlaneClosedError, UnknownFieldError

if TYPE_CHECKING:
    from relayrl.data_plane.ledger import PartitionRecord

PartitionState = dict[str, Any]
"""One partition: `fields`, `num_samples`, `tasks`, `grpo_group_size` (its declaration), `keys` (live keys in
first-put order), `schema` (field -> [jagged, dtype, trailing]), `written` (field -> the keys holding it, in key
order), `tags` (key -> tags, only keys that have some) and `consumed` (task -> claimed keys, in key order)."""


class LedgerStateMixin:
    """`export_state` / `restore_state` for `Ledger` (see module doc). Puts still in flight are not exported: they
    are not visible yet, and a checkpoint is taken between steps, when none is."""

    _parts: dict[str, PartitionRecord]
    _lock: threading.RLock
    _changed: threading.Condition
    _closed: bool
    storage_capacity: int

    if TYPE_CHECKING:  # provided by Ledger

        def _part(self, partition_id: str) -> PartitionRecord: ...

        def _held(self) -> int: ...

    def export_state(self) -> dict[str, PartitionState]:
        """Every registered partition's bookkeeping, in registration order."""
        with self._lock:
            if self._closed:
                raise DataPlaneClosedError("the data plane store is closed")
            out: dict[str, PartitionState] = {}
            for pid, part in self._parts.items():
                keys = list(part.rows)
                rows = part.row_ids(keys)  # [n]
                written = {}
                for name in part.schema:
                    marks = part.written[name].index_select(0, rows).tolist() if keys else []
                    written[name] = [k for k, m in zip(keys, marks) if m >= 0]
                out[pid] = {
                    "fields": list(part.fields),
                    "num_samples": part.num_samples,
                    "tasks": list(part.tasks),
                    "grpo_group_size": part.grpo_group_size,
                    "keys": keys,
                    "schema": {name: [s.jagged, s.dtype, list(s.trailing)] for name, s in part.schema.items()},
                    "written": written,
                    "tags": {k: dict(part.tags[k]) for k in keys if k in part.tags},
                    "consumed": {t: [k for k in keys if k in part.consumed[t]] for t in part.tasks},
                }
            return out

    def restore_state(self, partition_id: str, state: Mapping[str, Any]) -> None:
        """Recreate a registered, empty partition's keys (in their order, nothing written yet), schemas, tags and
        claim cursors from `export_state`; the caller then puts each field's tensors back under the same keys."""
        with self._lock:
            part = self._part(partition_id)
            if part.rows or part.reserved:
                raise ValueError(f"restore_state: partition {partition_id!r} already holds samples")
            keys = list(state["keys"])
            unknown = [n for n in state["schema"] if n not in part.fields]
            if unknown:
                raise UnknownFieldError(f"restore_state: field(s) {unknown} not declared for {partition_id!r}")
            held = self._held()
            if held + len(keys) > self.storage_capacity:
                raise CapacityExceededError(
                    f"restoring {len(keys)} samples to {partition_id!r} would hold {held + len(keys)} samples, above "
                    f"data_plane.storage_capacity={self.storage_capacity}"
                )
            part.grow(len(keys))
            part.rows.update(zip(keys, range(len(keys))))
            part.next_row = len(keys)
            for name, (jagged, dtype, trailing) in state["schema"].items():
                part.schema[name] = FieldSpec(bool(jagged), str(dtype), tuple(int(d) for d in trailing))
                part.written[name] = torch.full((part.row_capacity,), -1, dtype=torch.int64)
            part.tags.update({k: dict(t) for k, t in state["tags"].items()})
            for task, claimed in state["consumed"].items():
                if task in part.consumed:
                    part.consumed[task].update(claimed)
            self._changed.notify_all()

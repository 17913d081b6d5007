"""The one client shape shared by every backend: a `DataPlaneClient` that forwards to a hosted ledger.

Why: the memory client, the `ray` client and the `transfer_queue` client all forward the same ledger calls
(declare, claim, consumption status, clear, introspection); only the transport differs. A direct call in this
process (`memory.MemoryDataPlaneClient`) or one Ray actor call with a deadline (`remote.RemoteClient`).

A call names the hosted method itself (`self._call(Ledger.claim_meta, ...)`), so its arguments and result are
type-checked against that method; the transport looks the method up by name on the hosted object, so a
subclass's override (the memory store's `bytes_held`) is what runs.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from relayrl.data_plane.checksum import NO_CHECKSUM, batch_digests, row_digests
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import (
    ChecksumMismatchError,
    DataPlaneClient,
    DataPlaneClosedError,
    FieldBatch,
    FieldValue,
    KVBatchMeta,
    Tags,
    check_put,
    format_keys,
)
from relayrl.data_plane.ledger import Ledger

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

DEFAULT_CALL_TIMEOUT_S = 120.0
"""Upper bound for one put/get/clear round trip; a dead or wedged store surfaces as an error, not a hang."""


def verify_rows(
    batch: Mapping[str, Column], stored: Mapping[str, torch.Tensor], keys: Sequence[str], partition_id: str
) -> int:
    """Compare each fetched field's rows with the digests recorded at put (`stored`, `[N]` per field, in `keys`
    order). Raises `ChecksumMismatchError` naming the first corrupted key and field; returns how many (row, field)
    pairs had no checksum recorded and so could not be verified."""
    unverified = 0
    for name, recorded in stored.items():
        got, want = row_digests(batch[name]).numpy(), recorded.numpy()  # [N], [N]
        if np.array_equal(got, want):  # the common case, one comparison
            continue
        has = want != NO_CHECKSUM  # [N]
        bad = (got != want) & has
        unverified += int((~has).sum())
        if bool(bad.any()):
            wrong = [keys[i] for i in np.flatnonzero(bad).tolist()]
            others = f" ({len(wrong)} rows of this field differ: {format_keys(wrong)})" if len(wrong) > 1 else ""
            raise ChecksumMismatchError(
                f"data plane checksum mismatch in partition {partition_id!r}: key {wrong[0]!r}, field '{name}' is "
                f"not what was put (the store or the transfer changed it){others}",
                key=wrong[0],
                field=name,
            )
    return unverified


class ChecksumStats:
    """What checksums cost this client (CPU seconds of the calling threads computing and verifying them: a wait for
    the GIL or a busy core is not their cost) and rows that carried none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.unverified = 0

    def add(self, seconds: float, unverified: int) -> None:
        with self._lock:
            self.seconds += seconds
            self.unverified += unverified

    def take(self) -> tuple[float, int]:
        """(seconds, unverified rows) since the last take."""
        with self._lock:
            out = (self.seconds, self.unverified)
            self.seconds, self.unverified = 0.0, 0
            return out


class ProxyClient(DataPlaneClient):
    """Ledger calls forwarded through `_call_within`, the transport each backend supplies; puts and gets are
    checked here once and handed to the backend's `_put` / `_get`, which move the bulk data."""

    def __init__(self, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, *, verify_checksums: bool = True):
        self._timeout = call_timeout_s
        self._closed = False
        self.verify_checksums = verify_checksums
        self.checksums = ChecksumStats()

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneClosedError("this data plane client is closed")

    @abstractmethod
    def _call_within(
        self, timeout_s: float, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Run the hosted object's `method` (looked up by name), waiting at most `timeout_s` where the transport
        can bound a wait. Raises `DataPlaneClosedError` once this client is closed."""

    def _call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return self._call_within(self._timeout, method, *args, **kwargs)

    # ------------------------------------------------------------------ task-mediated
    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int,
        consumer_tasks: Sequence[str],
        grpo_group_size: int | None = None,
    ) -> None:
        if isinstance(fields, str) or isinstance(consumer_tasks, str):
            raise TypeError("fields and consumer_tasks must be sequences of names, not a single string")
        self._call(
            Ledger.register_partition, partition_id, list(fields), num_samples, list(consumer_tasks), grpo_group_size
        )

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
        # The ledger enforces timeout_s itself; the round-trip bound only adds headroom for the call.
        wait = max(0.0, timeout_s) + self._timeout if blocking else self._timeout
        required = list(required_fields)
        return self._call_within(
            wait, Ledger.claim_meta, partition_id, task_name, required, batch_size, dp_rank, blocking, timeout_s
        )

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        return self._call(Ledger.check_consumption_status, partition_id, list(task_names))

    # ------------------------------------------------------------------ direct by key
    def put_samples(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Mapping[str, FieldValue],
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        self._check_open()
        key_list, cols = check_put(keys, fields, tags)
        sums = None
        if self.verify_checksums:
            start = time.thread_time()
            sums = batch_digests(cols)
            self.checksums.add(time.thread_time() - start, 0)
        return self._put(key_list, partition_id, cols, None if tags is None else [dict(t) for t in tags], sums)

    @abstractmethod
    def _put(
        self,
        keys: list[str],
        partition_id: str,
        cols: dict[str, Column],
        tags: list[Tags] | None,
        checksums: dict[str, torch.Tensor] | None,
    ) -> KVBatchMeta:
        """Store a put whose arguments are consistent (`check_put`); the store validates it against the ledger and
        records `checksums` (`[n]` per field) when given."""

    def get_samples(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> FieldBatch:
        if isinstance(select_fields, str):
            raise TypeError("select_fields must be a sequence of field names, not a single string")
        key_list, names = list(keys), list(dict.fromkeys(select_fields))
        if not self.verify_checksums:
            return self._get(key_list, partition_id, names)
        batch, stored = self._get_checked(key_list, partition_id, names)
        start = time.thread_time()
        try:
            unverified = verify_rows(batch, stored, key_list, partition_id)
        finally:
            self.checksums.add(time.thread_time() - start, 0)
        self.checksums.add(0.0, unverified)
        return batch

    @abstractmethod
    def _get(self, keys: list[str], partition_id: str, names: list[str]) -> FieldBatch:
        """Fetch `names` (de-duplicated) for `keys`, rows in key order."""

    @abstractmethod
    def _get_checked(
        self, keys: list[str], partition_id: str, names: list[str]
    ) -> tuple[FieldBatch, dict[str, torch.Tensor]]:
        """`_get` plus the checksums recorded at put for the same rows and fields (`[n]` each, -1 where none)."""

    def clear_samples(self, keys: Sequence[str] | None, partition_id: str) -> int:
        if isinstance(keys, str):
            raise TypeError("clear_samples takes a sequence of keys (or None), not a single string")
        return self._call(Ledger.clear_samples, None if keys is None else list(keys), partition_id)

    def drop_partition(self, partition_id: str) -> bool:
        return self._call(Ledger.drop_partition, partition_id)

    # ------------------------------------------------------------------ observability
    def bytes_held(self) -> dict[str, int]:
        return {} if self._closed else self._call(Ledger.bytes_held)

    def num_samples_held(self) -> int:
        return self._call(Ledger.num_samples_held)

    def keys(self, partition_id: str) -> list[str]:
        """Live keys of a partition in first-put order (leak checks, tests and debugging)."""
        return self._call(Ledger.keys, partition_id)

    def export_state(self) -> dict[str, dict[str, Any]]:
        return self._call(Ledger.export_state)

    def restore_state(self, partition_id: str, state: Mapping[str, Any]) -> None:
        self._call(Ledger.restore_state, partition_id, dict(state))

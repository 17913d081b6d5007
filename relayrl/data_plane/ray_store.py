"""The `ray` backend: the memory backend's `ColumnarStore` hosted in a named Ray actor.

Why an actor: policy workers are separate Ray processes (possibly on other nodes), so an in-process store is out
of their reach. Every process attaches by name (`ray.get_actor(name, namespace=...)`) and talks to the one store
through the shared Ray transport (`remote.py`); only the bulk wire form lives here.

Bulk data never travels as pickled Python lists: each `Column` is sent as plain numpy arrays (values + lengths),
so Ray places them in its shared-memory object store and readers map them without deserialising element by
element. A put is one `ray.put` of the packed columns plus one actor call (the store then keeps its own copy); a
get is one actor call whose packed result the caller maps straight from the object store. The actor is threaded
(the store is thread-safe), so one worker's gather or a blocking `claim_meta` never stalls the others.
"""

from __future__ import annotations

import warnings
from typing import cast

import numpy as np
import ray
import torch
from ray.actor import ActorClass, ActorHandle

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import FieldBatch, KVBatchMeta, Tags
from relayrl.data_plane.memory import ColumnarStore
from relayrl.data_plane.proxy import DEFAULT_CALL_TIMEOUT_S
from relayrl.data_plane.remote import NAMESPACE, LedgerHost, RemoteClient, knob, lookup_actor, run_scoped, start_host

ACTOR_NAME = "relayrl_data_plane"

# (dtype name, values array, lengths array or None); numpy has no bf16/fp8, so those travel as same-width ints.
WireColumn = tuple[str, np.ndarray, np.ndarray | None]
WireBatch = dict[str, WireColumn]
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------------- wire format
def column_to_wire(col: Column) -> WireColumn:
    """Column → numpy arrays the object store can hold zero-copy (no per-element pickling)."""
    values = col.values.detach().to("cpu").contiguous()
    try:
        arr = values.numpy()
    except TypeError:  # dtype numpy lacks (bfloat16, float8...): reinterpret the bits, never cast
        arr = values.view(_INT_OF_WIDTH[values.element_size()]).numpy()
    lengths = None if col.lengths is None else col.lengths.to("cpu").contiguous().numpy()
    return str(col.dtype).removeprefix("torch."), arr, lengths


def column_from_wire(wire: WireColumn, *, copy: bool) -> Column:
    """Inverse of `column_to_wire`. `copy=True` gives tensors owning their memory (not the object store's)."""
    dtype_name, arr, lengths = wire
    dtype = getattr(torch, dtype_name)
    with warnings.catch_warnings():  # arrays mapped from the object store are flagged read-only
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(arr)
        lens = None if lengths is None else torch.from_numpy(lengths)
    if values.dtype != dtype:
        values = values.view(dtype)
    if copy:
        values = values.clone()
        lens = None if lens is None else lens.clone()
    return Column(values, lens)


# ---------------------------------------------------------------------------------------------------- the actor
class StoreActor(LedgerHost):
    """Hosts one ColumnarStore; adds the put and get that move columns in wire form."""

    ledger: ColumnarStore

    def __init__(self, storage_capacity: int, torch_threads: int = 1):
        # The store only copies and gathers; concurrency comes from serving several callers at once. Intra-op
        # threads on top of that fight over the cores and make each copy many times slower on a busy machine
        # (docs/design.md, CPU performance).
        torch.set_num_threads(torch_threads)
        super().__init__(storage_capacity)

    def _new_ledger(self, storage_capacity: int) -> ColumnarStore:
        return ColumnarStore(storage_capacity)

    def put(
        self,
        keys: list[str],
        partition_id: str,
        wire: WireBatch,
        tags: list[Tags] | None,
        checksums: dict[str, torch.Tensor] | None = None,
    ) -> KVBatchMeta:
        # No copy here: the store makes its own private copy of every put.
        cols = {name: column_from_wire(w, copy=False) for name, w in wire.items()}
        return self.ledger.put_samples(keys, partition_id, cols, tags, checksums)

    def get(self, keys: list[str], partition_id: str, names: list[str]) -> WireBatch:
        batch = self.ledger.get_samples(keys, partition_id, names)
        return {name: column_to_wire(col) for name, col in batch.items()}

    def get_checked(
        self, keys: list[str], partition_id: str, names: list[str]
    ) -> tuple[WireBatch, dict[str, torch.Tensor]]:
        batch, checksums = self.ledger.get_samples_checked(keys, partition_id, names)
        return {name: column_to_wire(col) for name, col in batch.items()}, checksums


_RemoteStore: ActorClass[LedgerHost] = ray.remote(StoreActor)


# ---------------------------------------------------------------------------------------------------- the client
class RayDataPlaneClient(RemoteClient):
    """DataPlaneClient talking to the named store actor; usable from any process of the Ray cluster."""

    _label = "ray data plane"

    def _put(
        self,
        keys: list[str],
        partition_id: str,
        cols: dict[str, Column],
        tags: list[Tags] | None,
        checksums: dict[str, torch.Tensor] | None,
    ) -> KVBatchMeta:
        wire = {name: column_to_wire(col) for name, col in cols.items()}
        # Bulk goes to the object store once; Ray hands the actor the value of a top-level ObjectRef argument.
        payload = cast(WireBatch, ray.put(wire))
        return self._call(StoreActor.put, keys, partition_id, payload, tags, checksums)

    def _get(self, keys: list[str], partition_id: str, names: list[str]) -> FieldBatch:
        wire = self._call(StoreActor.get, keys, partition_id, names)
        # Zero-copy: the tensors map this call's own result object in the object store (a copy the store made
        # for this caller alone, so writing to them is safe); it is released when they are dropped.
        return {name: column_from_wire(w, copy=False) for name, w in wire.items()}

    def _get_checked(
        self, keys: list[str], partition_id: str, names: list[str]
    ) -> tuple[FieldBatch, dict[str, torch.Tensor]]:
        wire, checksums = self._call(StoreActor.get_checked, keys, partition_id, names)
        return {name: column_from_wire(w, copy=False) for name, w in wire.items()}, checksums

    def close(self) -> None:
        """Idempotent. The bootstrapping client also stops the actor; attached clients only let go of it."""
        if self._closed:
            return
        if self._owns_actor:
            self._stop_actor()
        self._closed = True


# ---------------------------------------------------------------------------------------------------- factory
def _lookup(name: str) -> ActorHandle[LedgerHost] | None:
    return lookup_actor(name, NAMESPACE)


def build_client(
    cfg: DataPlaneConfig,
    *,
    bootstrap: bool,
    actor_name: str | None = None,
    call_timeout_s: float | None = None,
) -> RayDataPlaneClient:
    """Driver (`bootstrap=True`): start the named store actor on this node. Workers: attach to it by name.

    The name defaults to `ACTOR_NAME` plus the driver's Ray job id (`run_scoped`): unique to the run.
    `call_timeout_s` defaults to `cfg.call_timeout_s` when the config has that key, else 120 s."""
    timeout = knob(cfg, "call_timeout_s", call_timeout_s, DEFAULT_CALL_TIMEOUT_S)
    if not ray.is_initialized():
        raise RuntimeError(
            "data_plane.backend='ray' needs a running Ray: call ray.init(...) (or connect to the cluster) first"
        )
    actor_name = actor_name or run_scoped(ACTOR_NAME)
    existing = _lookup(actor_name)
    if not bootstrap:
        if existing is None:
            raise RuntimeError(
                f"no ray data plane store named {actor_name!r} in namespace {NAMESPACE!r}; "
                "the driver must build its client with bootstrap=True first"
            )
        return RayDataPlaneClient(
            existing, owns_actor=False, call_timeout_s=timeout, verify_checksums=cfg.verify_checksums
        )
    if existing is not None:
        raise RuntimeError(
            f"a ray data plane store named {actor_name!r} already runs in namespace {NAMESPACE!r}; attach to it "
            "with bootstrap=False, or close the client that started it"
        )
    from relayrl.distributed.ray_nodes import on_driver_node

    try:
        actor = start_host(
            _RemoteStore,
            actor_name,
            cfg.storage_capacity,
            max(1.0, timeout),
            scheduling_strategy=on_driver_node(),  # the driver writes most data; a lost node never holds it
        )
    except Exception as e:
        raise RuntimeError(f"the ray data plane store actor did not start: {type(e).__name__}: {e}") from e
    return RayDataPlaneClient(actor, owns_actor=True, call_timeout_s=timeout, verify_checksums=cfg.verify_checksums)

"""The `ray` backend: the memory backend's `ColumnarStore` hosted in a named Ray actor.

Why an actor: policy workers are separate Ray processes (possibly on other nodes), so an in-process store is out
of their reach. Every process attaches by name (`ray.get_actor(name, namespace=...)`) and talks to the one store.

Bulk data never travels as pickled Python lists: each `Column` is sent as plain numpy arrays (values + lengths),
so Ray places them in its shared-memory object store and readers map them without deserialising element by
element. A put is one `ray.put` of the packed columns plus one actor call (the store then keeps its own copy); a
get is one actor call whose packed result the caller maps straight from the object store. The actor is threaded
(the store is thread-safe), so one worker's gather or a blocking `claim_meta` never stalls the others.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from relayrl.config import DataPlaneConfig
from relayrl.data_plane import interfaces as ifc
from relayrl.data_plane.codec import Column, as_column
from relayrl.data_plane.interfaces import (
    ClaimTimeoutError,
    DataPlaneClient,
    DataPlaneClosedError,
    DataPlaneError,
    FieldBatch,
    FieldValue,
    KVBatchMeta,
    resolve_fields,
)
from relayrl.data_plane.memory import ColumnarStore

ACTOR_NAME = "relayrl_data_plane"
NAMESPACE = "relayrl"
DEFAULT_CALL_TIMEOUT_S = 120.0
"""Upper bound for one put/get/clear round trip; a dead or wedged store surfaces as an error, not a hang."""
_ACTOR_MAX_CONCURRENCY = 32

# (dtype name, values array, lengths array or None); numpy has no bf16/fp8, so those travel as same-width ints.
WireColumn = tuple[str, np.ndarray, np.ndarray | None]
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


class RemoteError(Exception):
    """Picklable carrier for a data-plane error raised inside the actor (some error classes take extra init
    arguments and do not survive pickling); the client re-raises the original class."""

    def __init__(self, kind: str, message: str, missing: list[str] | None = None):
        super().__init__(kind, message, missing)
        self.kind, self.message, self.missing = kind, message, missing


def rebuild(err: RemoteError) -> Exception:
    """The original data-plane error carried by `err` (RuntimeError if its class is unknown here)."""
    cls = getattr(ifc, err.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, DataPlaneError)):
        return RuntimeError(f"{err.kind}: {err.message}")
    if err.missing is not None:
        return cls(err.message, err.missing)
    return cls(err.message)


def await_remote(ref: Any, timeout_s: float, what: str) -> Any:
    """`ray.get` with a deadline; an error raised in the actor comes back as its own class, a dead actor as
    `DataPlaneClosedError`, an overrun as `ClaimTimeoutError`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        try:
            ray.cancel(ref)
        except Exception:  # best effort: some actor tasks cannot be cancelled
            pass
        raise ClaimTimeoutError(f"{what} did not complete within {timeout_s:.1f}s") from None
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, RemoteError):
            raise rebuild(cause) from None
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except RayActorError as e:
        raise DataPlaneClosedError(f"{what}: the actor serving it is gone ({type(e).__name__})") from e


def carry(fn: Any) -> Any:
    """Run `fn` in the actor, turning data-plane errors into `RemoteError`."""
    try:
        return fn()
    except DataPlaneError as e:
        raise RemoteError(type(e).__name__, str(e), getattr(e, "missing", None)) from None


# ---------------------------------------------------------------------------------------------------- the actor
class StoreActor:
    """Hosts one ColumnarStore; methods mirror the client contract with columns in wire form."""

    def __init__(self, storage_capacity: int, torch_threads: int = 1):
        # The store only copies and gathers; concurrency comes from serving several callers at once. Intra-op
        # threads on top of that fight over the cores (a 1 MB clone measured 30-100x slower with 2 threads on a
        # busy 2-core box).
        torch.set_num_threads(torch_threads)
        self.store = ColumnarStore(storage_capacity)

    def ping(self) -> bool:
        return True

    def register_partition(self, *args: Any) -> None:
        carry(lambda: self.store.register_partition(*args))

    def claim_meta(self, *args: Any) -> KVBatchMeta:
        return carry(lambda: self.store.claim_meta(*args))

    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> bool:
        return carry(lambda: self.store.check_consumption_status(partition_id, task_names))

    def put(
        self, keys: list[str], partition_id: str, wire: dict[str, WireColumn], tags: list[dict[str, Any]] | None
    ) -> KVBatchMeta:
        # No copy here: the store makes its own private copy of every put.
        cols = {name: column_from_wire(w, copy=False) for name, w in wire.items()}
        return carry(lambda: self.store.put_samples(keys, partition_id, cols, tags))

    def get(self, keys: list[str], partition_id: str, names: list[str]) -> dict[str, WireColumn]:
        batch = carry(lambda: self.store.get_samples(keys, partition_id, names))
        return {name: column_to_wire(col) for name, col in batch.items()}

    def clear(self, keys: list[str] | None, partition_id: str) -> int:
        return carry(lambda: self.store.clear_samples(keys, partition_id))

    def bytes_held(self) -> dict[str, int]:
        return self.store.bytes_held()

    def num_samples_held(self) -> int:
        return self.store.num_samples_held()

    def keys(self, partition_id: str) -> list[str]:
        return carry(lambda: self.store.keys(partition_id))

    def reset(self, storage_capacity: int | None) -> None:
        old = self.store
        self.store = ColumnarStore(old.storage_capacity if storage_capacity is None else storage_capacity)
        old.close()  # wakes blocked claims on the old store with DataPlaneClosedError

    def close(self) -> None:
        self.store.close()


_RemoteStore: Any = ray.remote(StoreActor)


# ---------------------------------------------------------------------------------------------------- the client
class RayDataPlaneClient(DataPlaneClient):
    """DataPlaneClient talking to the named store actor; usable from any process of the Ray cluster."""

    def __init__(self, actor: Any, *, owns_actor: bool, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        self._actor = actor
        self._owns_actor = owns_actor
        self._timeout = call_timeout_s
        self._closed = False

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        if self._closed:
            raise DataPlaneClosedError("this data plane client is closed")
        timeout = self._timeout if timeout_s is None else timeout_s
        return await_remote(getattr(self._actor, method).remote(*args), timeout, f"ray data plane {method}")

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
        self._call("register_partition", partition_id, list(fields), num_samples, list(consumer_tasks), grpo_group_size)

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
        # The store enforces timeout_s itself; the round-trip bound only adds headroom for the call.
        wait = max(0.0, timeout_s) + self._timeout if blocking else self._timeout
        args = (partition_id, task_name, list(required_fields), batch_size, dp_rank, blocking, timeout_s)
        return self._call("claim_meta", *args, timeout_s=wait)

    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> FieldBatch:
        return self.get_samples(meta.keys, meta.partition_id, resolve_fields(meta, select_fields))

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        return self._call("check_consumption_status", partition_id, list(task_names))

    # ------------------------------------------------------------------ direct by key
    def put_samples(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Mapping[str, FieldValue],
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        if self._closed:
            raise DataPlaneClosedError("this data plane client is closed")
        wire = {name: column_to_wire(as_column(name, value)) for name, value in fields.items()}
        payload = ray.put(wire)  # bulk goes to the object store once; the actor maps it from there
        tag_list = None if tags is None else [dict(t) for t in tags]
        return self._call("put", list(keys), partition_id, payload, tag_list)

    def get_samples(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> FieldBatch:
        if isinstance(select_fields, str):
            raise TypeError("select_fields must be a sequence of field names, not a single string")
        wire = self._call("get", list(keys), partition_id, list(select_fields))
        # Zero-copy: the tensors map this call's own result object in the object store (a copy the store made
        # for this caller alone, so writing to them is safe); it is released when they are dropped.
        return {name: column_from_wire(w, copy=False) for name, w in wire.items()}

    def clear_samples(self, keys: Sequence[str] | None, partition_id: str) -> int:
        if isinstance(keys, str):
            raise TypeError("clear_samples takes a sequence of keys (or None), not a single string")
        return self._call("clear", None if keys is None else list(keys), partition_id)

    # ------------------------------------------------------------------ lifecycle and observability
    def close(self) -> None:
        """Idempotent. The bootstrapping client also stops the actor; attached clients only let go of it."""
        if self._closed:
            return
        try:
            if self._owns_actor:
                try:
                    ray.get(self._actor.close.remote(), timeout=self._timeout)
                finally:
                    ray.kill(self._actor)
        except Exception:  # the actor may already be gone with its cluster; closing must still succeed
            pass
        finally:
            self._closed = True

    def bytes_held(self) -> dict[str, int]:
        return {} if self._closed else self._call("bytes_held")

    def num_samples_held(self) -> int:
        return self._call("num_samples_held")

    def keys(self, partition_id: str) -> list[str]:
        """Live keys of a partition in first-put order (tests and debugging)."""
        return self._call("keys", partition_id)

    def reset(self, storage_capacity: int | None = None) -> None:
        """Drop every partition of the shared store (optionally changing its capacity), for every attached
        client at once. For tests and between runs; never while a step is in flight."""
        self._call("reset", storage_capacity)


# ---------------------------------------------------------------------------------------------------- factory
def knob(cfg: Any, name: str, given: Any, default: Any) -> Any:
    """An explicit argument, else the config key if this config version has it, else the default."""
    if given is not None:
        return given
    value = getattr(cfg, name, None)
    return default if value is None else value


def _lookup(name: str) -> Any:
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def build_client(
    cfg: DataPlaneConfig,
    *,
    bootstrap: bool,
    actor_name: str = ACTOR_NAME,
    call_timeout_s: float | None = None,
) -> RayDataPlaneClient:
    """Driver (`bootstrap=True`): start the named store actor on this node. Workers: attach to it by name.

    `call_timeout_s` defaults to `cfg.call_timeout_s` when the config has that key, else 120 s."""
    call_timeout_s = knob(cfg, "call_timeout_s", call_timeout_s, DEFAULT_CALL_TIMEOUT_S)
    if not ray.is_initialized():
        raise RuntimeError(
            "data_plane.backend='ray' needs a running Ray: call ray.init(...) (or connect to the cluster) first"
        )
    existing = _lookup(actor_name)
    if not bootstrap:
        if existing is None:
            raise RuntimeError(
                f"no ray data plane store named {actor_name!r} in namespace {NAMESPACE!r}; "
                "the driver must build its client with bootstrap=True first"
            )
        return RayDataPlaneClient(existing, owns_actor=False, call_timeout_s=call_timeout_s)
    if existing is not None:
        raise RuntimeError(
            f"a ray data plane store named {actor_name!r} already runs in namespace {NAMESPACE!r}; attach to it "
            "with bootstrap=False, or close the client that started it"
        )
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()  # the driver writes most data: keep the store next to it
    actor = _RemoteStore.options(
        name=actor_name,
        namespace=NAMESPACE,
        num_cpus=0,
        max_concurrency=_ACTOR_MAX_CONCURRENCY,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=True),
    ).remote(cfg.storage_capacity)
    client = RayDataPlaneClient(actor, owns_actor=True, call_timeout_s=call_timeout_s)
    deadline = time.monotonic() + call_timeout_s
    try:
        ray.get(actor.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
    except Exception as e:
        client.close()
        raise RuntimeError(f"the ray data plane store actor did not start: {type(e).__name__}: {e}") from e
    return client

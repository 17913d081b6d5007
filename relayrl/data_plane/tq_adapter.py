"""The `transfer_queue` backend: an adapter over the `transferqueue` package (the only module that imports it).

TransferQueue (TQ) keeps the bulk data (a controller actor + `SimpleStorage` unit actors, ZMQ between them). On its
own it answers silently in each case below where our contract is strict, so this adapter compensates:

- partial gets (missing keys dropped), empty results for unknown or half-written fields, silent dtype truncation
  after a dtype change, keys left registered by a failed put, no capacity total, no partial or ordered claims:
  the data plane's own `Ledger` (ledger.py, the same bookkeeping the memory store runs), hosted in a small named
  actor (remote.py), is the authority for partitions, field schemas (dtype, layout, trailing shape fixed by
  the first write), live keys, written fields, tags, capacity and task cursors. Every put is
  validated there before TQ sees it, verified after it and only then published; every get is checked there
  (in parallel with the TQ call) so a short or empty TQ answer can never pass as a result;
- calls without timeouts (a dead controller hangs forever): every TQ coroutine runs with a deadline;
- `tq.init()` hanging on a cluster with too few CPUs, or silently creating a new TQ when asked to attach:
  checked up front with one-line errors; `tq.close()` killing the controller from any process: only the
  bootstrapping client ever calls it;
- every field coming back as a nested tensor: columns are rebuilt from the recorded layout, dtype checked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import psutil
import ray
import torch
from ray.actor import ActorClass, ActorHandle

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column, FieldSpec
from relayrl.data_plane.interfaces import (
    ClaimTimeoutError,
    DataPlaneClosedError,
    FieldBatch,
    KVBatchMeta,
    Tags,
    put_receipt,
)
from relayrl.data_plane.ledger import Ledger
from relayrl.data_plane.proxy import DEFAULT_CALL_TIMEOUT_S
from relayrl.data_plane.remote import LedgerHost, RemoteClient, knob, lookup_actor, run_scoped, start_host

# TQ reads these at import time. Cap its per-call torch threads at the physical cores (it warns on every call
# otherwise) and keep its log at WARNING; explicit user settings win.
os.environ.setdefault("TQ_NUM_THREADS", str(psutil.cpu_count(logical=False) or 1))
os.environ.setdefault("TQ_LOGGING_LEVEL", "WARNING")
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402

TQ_CONTROLLER_NAME = "TransferQueueController"  # fixed by the package
TQ_NAMESPACE = "transfer_queue"
LEDGER_NAME = "relayrl_tq_ledger"
DEFAULT_NUM_STORAGE_UNITS = 2
DEFAULT_INIT_TIMEOUT_S = 300.0
"""A wide margin: starting takes tens of seconds on a loaded machine (three actor processes each import torch)."""
_CPU_WAIT_S = 15.0

R = TypeVar("R")

_RemoteLedger: ActorClass[LedgerHost] = ray.remote(LedgerHost)


def _run_with_timeout(fn: Callable[[], R], timeout_s: float, what: str, key: str = "data_plane.call_timeout_s") -> R:
    """Run a blocking call that has no timeout of its own in a daemon thread; raise if it overruns."""
    box: dict[str, R] = {}
    failed: list[BaseException] = []

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed back to the caller below
            failed.append(e)

    t = threading.Thread(target=target, name=f"relayrl-tq-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ClaimTimeoutError(f"transfer_queue: {what} did not finish within {timeout_s:g}s ({key})")
    if failed:
        raise failed[0]
    return box["value"]


def _to_wire(col: Column) -> torch.Tensor:
    """Column → what TQ accepts: a jagged nested tensor, or the dense `[N, *trailing]` values."""
    values = col.values.detach().to("cpu").contiguous()
    if col.lengths is None:
        return values
    offsets = torch.zeros(col.lengths.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(col.lengths, 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _from_wire(name: str, value: object, spec: FieldSpec, n: int) -> Column:
    """TQ returns every multi-dim field as a nested tensor (dense ones too); rebuild the recorded layout."""
    jagged, dtype_name, trailing = spec
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"transfer_queue returned a {type(value).__name__} for tensor field '{name}'")
    if value.is_nested:
        if value.layout != torch.jagged:
            raise RuntimeError(f"transfer_queue returned field '{name}' as a strided nested tensor")
        flat, lengths = value.values(), value.offsets().to(torch.int64).diff()  # type: ignore[attr-defined]
    else:
        flat = value.reshape(-1, *trailing)
        per_row = flat.shape[0] // n if n else 0
        lengths = torch.full((n,), per_row, dtype=torch.int64)
    if str(flat.dtype).removeprefix("torch.") != dtype_name:
        raise RuntimeError(
            f"transfer_queue returned field '{name}' as {flat.dtype}, but it was written as {dtype_name}"
        )
    if jagged:
        return Column(flat.reshape(-1, *trailing).contiguous(), lengths.contiguous())
    return Column(flat.reshape(n, *trailing).contiguous())


def _take(col: Column, idx: torch.Tensor) -> Column:
    """Rows `idx` of a column (used only when a get names the same key more than once)."""
    if col.lengths is None:
        return Column(col.values.index_select(0, idx))
    lens = col.lengths.index_select(0, idx)
    starts = col.offsets.index_select(0, idx)
    total = int(lens.sum())
    flat = torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens, output_size=total)
    return Column(col.values.index_select(0, flat + torch.arange(total)), lens)


class TQDataPlaneClient(RemoteClient):
    """DataPlaneClient over TransferQueue (bulk) plus the relayrl ledger actor (bookkeeping)."""

    _label = "transfer_queue ledger"

    def __init__(
        self,
        ledger: ActorHandle[LedgerHost],
        *,
        owns_tq: bool,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        verify_checksums: bool = True,
    ):
        super().__init__(ledger, owns_actor=owns_tq, call_timeout_s=call_timeout_s, verify_checksums=verify_checksums)
        self._tq_client = tq.get_client()
        if not isinstance(getattr(self._tq_client, "_loop", None), asyncio.AbstractEventLoop):
            raise RuntimeError("this transferqueue version has no client event loop; relayrl needs 0.1.10-0.1.x")

    # ------------------------------------------------------------------ plumbing
    def _check_open(self) -> None:
        super()._check_open()
        if getattr(tq.interface, "_TQ_CLIENT", None) is not self._tq_client:  # tq.close() ran in this process
            raise DataPlaneClosedError("the TransferQueue this client attached to was closed")

    def _tq(self, coro: Coroutine[Any, Any, R], what: str) -> R:
        """Run one TQ coroutine on TQ's client loop with a deadline (TQ's controller calls have none)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._tq_client._loop)
        try:
            return fut.result(self._timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise ClaimTimeoutError(
                f"transfer_queue: {what} did not finish within {self._timeout:g}s (data_plane.call_timeout_s)"
            ) from None

    # ------------------------------------------------------------------ direct by key
    def _put(
        self,
        keys: list[str],
        partition_id: str,
        cols: dict[str, Column],
        tags: list[Tags] | None,
        checksums: dict[str, torch.Tensor] | None,
    ) -> KVBatchMeta:
        n = len(keys)
        specs = {name: FieldSpec.of(col) for name, col in cols.items()}
        new_keys, new_fields = self._call(Ledger.begin_put, partition_id, keys, specs)
        sent = False
        try:
            if n and (cols or tags):
                td = TensorDict({name: _to_wire(c) for name, c in cols.items()}, batch_size=[n]) if cols else None
                sent = True
                self._tq(
                    tq.async_kv_batch_put(keys=keys, partition_id=partition_id, fields=td, tags=tags),
                    f"put to partition {partition_id!r}",
                )
                if cols:  # TQ reports success even when the controller rejected the update: check it recorded all
                    meta = self._tq(
                        self._tq_client.async_kv_retrieve_meta(keys, partition_id, False),
                        f"put check on partition {partition_id!r}",
                    )
                    lost = [name for name in cols if name not in meta.field_names]
                    if meta.size != n or lost:
                        raise RuntimeError(
                            f"transfer_queue accepted a put to {partition_id!r} but recorded {meta.size}/{n} keys "
                            f"and is missing field(s) {lost}"
                        )
        except BaseException:
            self._roll_back(partition_id, keys, new_keys, list(cols) if sent else [], new_fields)
            raise
        lengths = {name: None if c.lengths is None else c.lengths.to("cpu") for name, c in cols.items()}
        self._call(Ledger.commit_put, partition_id, keys, lengths, tags, checksums)
        return put_receipt(partition_id, keys, list(cols), tags)

    def _roll_back(
        self, partition_id: str, keys: list[str], new_keys: list[str], sent_fields: list[str], new_fields: list[str]
    ) -> None:
        """Undo a failed put: its new keys leave TQ and the ledger. Keys it was overwriting may now hold a mix of
        old and new values in TQ, so the ledger forgets those fields for them: a later get raises
        FieldNotWrittenError naming them instead of returning the mix. Best effort; the put's error wins."""
        try:
            if new_keys and sent_fields:
                self._tq(
                    tq.async_kv_clear(keys=new_keys, partition_id=partition_id),
                    f"roll back on partition {partition_id!r}",
                )
        finally:
            self._call(Ledger.abort_put, partition_id, keys, new_keys, sent_fields, new_fields)

    def _get(self, keys: list[str], partition_id: str, names: list[str]) -> FieldBatch:
        # The ledger validates (and names what is wrong) while TQ looks the keys up: no added latency.
        check = self._submit(Ledger.check_get, partition_id, keys, names)
        uniq = list(dict.fromkeys(keys))
        meta = (
            self._tq(
                self._tq_client.async_kv_retrieve_meta(uniq, partition_id, False), f"get on partition {partition_id!r}"
            )
            if uniq
            else None
        )
        return self._fetch(
            keys, uniq, partition_id, names, meta, self._wait(check, f"check_get on partition {partition_id!r}")
        )

    def _get_checked(
        self, keys: list[str], partition_id: str, names: list[str]
    ) -> tuple[FieldBatch, dict[str, torch.Tensor]]:
        check = self._submit(Ledger.check_get_checksums, partition_id, keys, names)
        uniq = list(dict.fromkeys(keys))
        meta = (
            self._tq(
                self._tq_client.async_kv_retrieve_meta(uniq, partition_id, False), f"get on partition {partition_id!r}"
            )
            if uniq
            else None
        )
        specs, checksums = self._wait(check, f"check_get on partition {partition_id!r}")
        return self._fetch(keys, uniq, partition_id, names, meta, specs), checksums

    def _fetch(
        self,
        keys: list[str],
        uniq: list[str],
        partition_id: str,
        names: list[str],
        meta: Any,
        specs: dict[str, FieldSpec],
    ) -> FieldBatch:
        """The rows TQ holds for the checked get (`specs`: the ledger's schema of `names`), in `keys` order."""
        if not keys or not names:
            return {
                name: Column(
                    torch.empty((0, *s.trailing), dtype=s.torch_dtype),
                    torch.zeros(0, dtype=torch.int64) if s.jagged else None,
                )
                for name, s in specs.items()
            }
        assert meta is not None
        absent = [name for name in names if name not in meta.field_names]
        if meta.size != len(uniq) or absent:
            raise RuntimeError(
                f"transfer_queue lost data of partition {partition_id!r}: it holds {meta.size}/{len(uniq)} of the "
                f"requested keys and lacks field(s) {absent} that the ledger recorded as written"
            )
        td = self._tq(self._tq_client.async_get_data(meta.select_fields(names)), f"get on partition {partition_id!r}")
        out = {name: _from_wire(name, td.get(name), specs[name], len(uniq)) for name in names}
        if len(uniq) != len(keys):
            pos = {k: i for i, k in enumerate(uniq)}
            idx = torch.tensor([pos[k] for k in keys], dtype=torch.int64)  # [n]
            out = {name: _take(col, idx) for name, col in out.items()}
        return out

    def clear_samples(self, keys: Sequence[str] | None, partition_id: str) -> int:
        if isinstance(keys, str):
            raise TypeError("clear_samples takes a sequence of keys (or None), not a single string")
        present = self._call(Ledger.present, partition_id, None if keys is None else list(keys))
        if present:
            self._tq(tq.async_kv_clear(keys=present, partition_id=partition_id), f"clear on partition {partition_id!r}")
        return self._call(Ledger.clear_samples, present, partition_id)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Idempotent. Only the bootstrapping client stops TQ and the ledger (`tq.close()` from any process would
        kill the shared controller); attached clients just stop using them."""
        if self._closed:
            return
        self._closed = True
        if not self._owns_actor:
            return
        self._stop_actor()
        try:
            _run_with_timeout(tq.close, self._timeout, "close")
        except Exception:
            pass

    def reset(self, storage_capacity: int | None = None) -> None:
        """Drop every partition (ledger and TQ data), optionally changing the capacity, for every attached
        client at once. For tests and between runs; never while a step is in flight."""
        super().reset(storage_capacity)
        for pid, held in self._tq(self._tq_client.async_kv_list(None), "list").items():
            if held:  # TQ cannot drop an empty partition (it warns instead)
                self._tq(self._tq_client.async_clear_partition(pid), f"clear_partition on partition {pid!r}")


# ---------------------------------------------------------------------------------------------------- bootstrap
def _bootstrap(cfg: DataPlaneConfig, num_storage_units: int, init_timeout_s: float) -> ActorHandle[LedgerHost]:
    if lookup_actor(TQ_CONTROLLER_NAME, TQ_NAMESPACE) is not None or lookup_actor(run_scoped(LEDGER_NAME)) is not None:
        raise RuntimeError(  # the controller's name is fixed by the package: one TQ data plane per Ray cluster
            "a TransferQueue data plane already runs in this Ray cluster (one per cluster: the transferqueue "
            "package names its controller); attach with bootstrap=False, close the client that started it, or "
            "use data_plane.backend=ray for a second run on this cluster"
        )
    need = num_storage_units + 1
    deadline = time.monotonic() + _CPU_WAIT_S  # CPUs of a just-closed TQ come back a moment after its actors die
    while (free := ray.available_resources().get("CPU", 0.0)) < need and time.monotonic() < deadline:
        time.sleep(0.5)
    if free < need:  # tq.init() would otherwise wait forever for a storage unit that can never be placed
        raise RuntimeError(
            f"TransferQueue needs {need} free Ray CPUs (controller + {num_storage_units} storage units) but only "
            f"{free:g} are available; start Ray with ray.init(num_cpus>={need + 1}) or more"
        )
    conf = OmegaConf.create(
        {
            "controller": {"polling_mode": True},  # never let the single controller thread sleep on a claim
            "backend": {
                "storage_backend": "SimpleStorage",
                # Capacity is enforced exactly by the ledger; TQ's own check is per unit and rejects puts after
                # registering their keys, so it stays off.
                "SimpleStorage": {"total_storage_size": None, "num_data_storage_units": num_storage_units},
            },
        }
    )
    ledger = start_host(_RemoteLedger, run_scoped(LEDGER_NAME), cfg.storage_capacity, init_timeout_s)
    try:
        _run_with_timeout(lambda: tq.init(conf), init_timeout_s, "init", "data_plane.init_timeout_s")
    except BaseException:
        ray.kill(ledger)
        controller = lookup_actor(TQ_CONTROLLER_NAME, TQ_NAMESPACE)
        if controller is not None:
            ray.kill(controller)
        raise
    return ledger


def _attach(init_timeout_s: float) -> ActorHandle[LedgerHost]:
    ledger = lookup_actor(run_scoped(LEDGER_NAME))
    if lookup_actor(TQ_CONTROLLER_NAME, TQ_NAMESPACE) is None or ledger is None:
        # tq.init() here would silently start a second, empty TransferQueue instead of attaching.
        raise RuntimeError(
            "no TransferQueue data plane to attach to; the driver must build its client with bootstrap=True first"
        )
    _run_with_timeout(tq.init, init_timeout_s, "attach", "data_plane.init_timeout_s")
    return ledger


def build_client(
    cfg: DataPlaneConfig,
    *,
    bootstrap: bool,
    num_storage_units: int | None = None,
    call_timeout_s: float | None = None,
    init_timeout_s: float | None = None,
) -> TQDataPlaneClient:
    """Driver (`bootstrap=True`): start TQ's controller and `simple` storage units plus the ledger. Workers and
    rollout actors (`bootstrap=False`): attach to them.

    Each knob defaults to the config key of the same name when the config has it, else 2 units, 120 s per call
    and 300 s to start or attach."""
    num_storage_units = knob(cfg, "num_storage_units", num_storage_units, DEFAULT_NUM_STORAGE_UNITS)
    call_timeout_s = knob(cfg, "call_timeout_s", call_timeout_s, DEFAULT_CALL_TIMEOUT_S)
    init_timeout_s = knob(cfg, "init_timeout_s", init_timeout_s, DEFAULT_INIT_TIMEOUT_S)
    if not ray.is_initialized():
        raise RuntimeError("data_plane.backend='transfer_queue' needs a running Ray: call ray.init(num_cpus=...) first")
    if num_storage_units < 1:
        raise ValueError(f"num_storage_units must be >= 1, got {num_storage_units}")
    ledger = _bootstrap(cfg, num_storage_units, init_timeout_s) if bootstrap else _attach(init_timeout_s)
    return TQDataPlaneClient(
        ledger, owns_tq=bootstrap, call_timeout_s=call_timeout_s, verify_checksums=cfg.verify_checksums
    )

"""Observability: per-operation counts, keys, bytes and latencies (mean, max, p50, p90), bytes held per partition,
bytes that passed through the driver and the cost of row checksums, exposed as flat `data_plane/*` metrics for the
trainer's logger.

`MeteredDataPlaneClient` wraps any backend (the factory always applies it); each call is timed once and
recorded whether it succeeds or fails, then re-raised unchanged. Each client also ships its latency histograms
(`latency.py`); `merge_clients` adds up those of every client of a step (driver, workers, rollout actor) into
`data_plane/all/*` percentiles, and `strip_sketches` drops the histograms before a dict is logged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from relayrl.data_plane.codec import batch_nbytes
from relayrl.data_plane.interfaces import DataPlaneClient, FieldBatch, FieldValue, KVBatchMeta
from relayrl.data_plane.latency import HIST, LatencySketch

PREFIX = "data_plane/"
ALL = PREFIX + "all/"
CHECKSUM = "checksum/"
R = TypeVar("R")


@dataclass
class OpStats:
    count: int = 0
    errors: int = 0
    keys: int = 0
    bytes: int = 0
    seconds_total: float = 0.0
    seconds_max: float = 0.0
    sketch: LatencySketch = field(default_factory=LatencySketch)


class DataPlaneMetrics:
    """Thread-safe accumulators; `as_dict` renders them as `data_plane/<op>/<stat>` floats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: dict[str, OpStats] = {}
        self.driver_bytes = 0
        self.checksum_seconds: float | None = None  # None: the client computes no checksums
        self.unverified_rows = 0

    def record(self, op: str, *, n_keys: int, n_bytes: int, seconds: float, ok: bool) -> None:
        with self._lock:
            s = self.ops.setdefault(op, OpStats())
            s.count += 1
            s.seconds_total += seconds
            s.seconds_max = max(s.seconds_max, seconds)
            s.sketch.add(seconds * 1e3)
            if ok:
                s.keys += n_keys
                s.bytes += n_bytes
            else:
                s.errors += 1

    def add_driver_bytes(self, n: int) -> None:
        """Count payload bytes that crossed the driver process (puts and gets made there)."""
        with self._lock:
            self.driver_bytes += n

    def add_checksums(self, seconds: float, unverified: int) -> None:
        """Seconds this client spent computing and verifying row checksums; rows that had none to verify."""
        with self._lock:
            self.checksum_seconds = (self.checksum_seconds or 0.0) + seconds
            self.unverified_rows += unverified

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()
            self.driver_bytes = 0
            self.checksum_seconds = None if self.checksum_seconds is None else 0.0
            self.unverified_rows = 0

    def as_dict(self, held: Mapping[str, int] | None = None) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {}
            for op, s in sorted(self.ops.items()):
                base = f"{PREFIX}{op}/"
                out[base + "count"] = float(s.count)
                out[base + "errors"] = float(s.errors)
                out[base + "keys"] = float(s.keys)
                out[base + "bytes"] = float(s.bytes)
                out[base + "ms_total"] = s.seconds_total * 1e3
                out[base + "ms_mean"] = s.seconds_total * 1e3 / s.count
                out[base + "ms_max"] = s.seconds_max * 1e3
                out[base + "ms_p50"] = s.sketch.quantile(0.5)
                out[base + "ms_p90"] = s.sketch.quantile(0.9)
                out.update(s.sketch.to_metrics(base))
            out[PREFIX + "driver_bytes"] = float(self.driver_bytes)
            if self.checksum_seconds is not None:
                out[PREFIX + CHECKSUM + "cpu_ms"] = self.checksum_seconds * 1e3
            if self.unverified_rows:  # only ever non-zero when clients of one store disagree on verify_checksums
                out[PREFIX + CHECKSUM + "unverified_rows"] = float(self.unverified_rows)
        if held is not None:
            for pid, n in sorted(held.items()):
                out[f"{PREFIX}held_bytes/{pid}"] = float(n)
            out[PREFIX + "held_bytes_total"] = float(sum(held.values()))
        return out


class MeteredDataPlaneClient(DataPlaneClient):
    """Decorator recording every call in a `DataPlaneMetrics`; optional `on_event` gets one dict per call."""

    def __init__(
        self,
        inner: DataPlaneClient,
        *,
        is_driver: bool = False,
        metrics: DataPlaneMetrics | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.inner = inner
        self.is_driver = is_driver
        self.stats = metrics or DataPlaneMetrics()
        self.on_event = on_event

    def _run(
        self,
        op: str,
        partition_id: str,
        call: Callable[[], R],
        *,
        n_keys: int = 0,
        in_bytes: int = 0,
        out_bytes: Callable[[R], int] | None = None,
        out_keys: Callable[[R], int] | None = None,
    ) -> R:
        start = time.perf_counter()
        try:
            result = call()
        except BaseException as e:
            self._emit(op, partition_id, n_keys, 0, time.perf_counter() - start, type(e).__name__)
            raise
        seconds = time.perf_counter() - start
        n_bytes = in_bytes + (out_bytes(result) if out_bytes else 0)
        if out_keys is not None:
            n_keys = out_keys(result)
        if self.is_driver and n_bytes:
            self.stats.add_driver_bytes(n_bytes)
        self._emit(op, partition_id, n_keys, n_bytes, seconds, "ok")
        return result

    def _emit(self, op: str, pid: str, n_keys: int, n_bytes: int, seconds: float, status: str) -> None:
        self.stats.record(op, n_keys=n_keys, n_bytes=n_bytes, seconds=seconds, ok=status == "ok")
        if self.on_event is not None:
            self.on_event(
                {
                    "op": op,
                    "partition_id": pid,
                    "n_keys": n_keys,
                    "n_bytes": n_bytes,
                    "wall_ms": seconds * 1e3,
                    "status": status,
                }
            )

    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int,
        consumer_tasks: Sequence[str],
        grpo_group_size: int | None = None,
    ) -> None:
        self._run(
            "register",
            partition_id,
            lambda: self.inner.register_partition(partition_id, fields, num_samples, consumer_tasks, grpo_group_size),
            n_keys=num_samples,
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
        return self._run(
            "claim_meta",
            partition_id,
            lambda: self.inner.claim_meta(
                partition_id, task_name, required_fields, batch_size, dp_rank, blocking, timeout_s
            ),
            out_keys=lambda m: m.size,
        )

    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> FieldBatch:
        return self._run(
            "get_data",
            meta.partition_id,
            lambda: self.inner.get_data(meta, select_fields),
            n_keys=meta.size,
            out_bytes=batch_nbytes,
        )

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        return self._run(
            "check_consumption_status",
            partition_id,
            lambda: self.inner.check_consumption_status(partition_id, task_names),
        )

    def put_samples(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Mapping[str, FieldValue],
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return self._run(
            "put",
            partition_id,
            lambda: self.inner.put_samples(keys, partition_id, fields, tags),
            n_keys=len(keys),
            in_bytes=batch_nbytes(fields),
        )

    def get_samples(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> FieldBatch:
        return self._run(
            "get",
            partition_id,
            lambda: self.inner.get_samples(keys, partition_id, select_fields),
            n_keys=len(keys),
            out_bytes=batch_nbytes,
        )

    def clear_samples(self, keys: Sequence[str] | None, partition_id: str) -> int:
        return self._run(
            "clear", partition_id, lambda: self.inner.clear_samples(keys, partition_id), out_keys=lambda n: n
        )

    def drop_partition(self, partition_id: str) -> bool:
        return self.inner.drop_partition(partition_id)

    def close(self) -> None:
        self._run("close", "", self.inner.close)

    def bytes_held(self) -> dict[str, int]:
        return self.inner.bytes_held()

    def keys(self, partition_id: str) -> list[str]:
        return self.inner.keys(partition_id)

    def export_state(self) -> dict[str, dict[str, Any]]:
        return self.inner.export_state()

    def restore_state(self, partition_id: str, state: Mapping[str, Any]) -> None:
        self.inner.restore_state(partition_id, state)

    def metrics(self, reset: bool = False) -> dict[str, float]:
        try:
            held: dict[str, int] | None = self.inner.bytes_held()
        except Exception:  # a closed or unreachable backend still reports its counters
            held = None
        checksums = getattr(self.inner, "checksums", None)
        if checksums is not None and getattr(self.inner, "verify_checksums", False):
            self.stats.add_checksums(*checksums.take())
        out = self.stats.as_dict(held)
        if reset:
            self.stats.reset()
        return out


def merge_clients(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """`data_plane/all/*` over several clients' metrics: per op `ms_p50`, `ms_p90` (from the summed histograms, not
    an average of percentiles), `ms_total` and the summed histogram itself; `ms_total` over every op (the step's
    data-plane client-seconds, in ms) and `checksum/cpu_ms`. A part that already carries `data_plane/all/`
    histograms (a facade that merged its own workers) counts through those."""
    sketches: dict[str, LatencySketch] = {}
    totals: dict[str, float] = {}
    checksum_ms = 0.0
    for part in parts:
        base = ALL if any(k.startswith(ALL) and HIST in k for k in part) else PREFIX
        hists: dict[str, list[tuple[str, float]]] = {}
        for key, value in part.items():
            if not key.startswith(base) or (base == PREFIX and key.startswith(ALL)):
                continue
            rest = key[len(base) :]
            if rest == CHECKSUM + "cpu_ms":
                checksum_ms += value
                continue
            bits = rest.split("/")
            if len(bits) == 3 and bits[1] + "/" == HIST:
                hists.setdefault(bits[0], []).append((key, value))
            elif len(bits) == 2 and bits[1] == "ms_total":
                totals[bits[0]] = totals.get(bits[0], 0.0) + value
        for op, items in hists.items():
            sketches.setdefault(op, LatencySketch()).merge(LatencySketch.from_metrics(items))
    out: dict[str, float] = {}
    for op in sorted(sketches):
        sketch, base = sketches[op], f"{ALL}{op}/"
        out[base + "ms_p50"] = sketch.quantile(0.5)
        out[base + "ms_p90"] = sketch.quantile(0.9)
        out[base + "ms_total"] = totals.get(op, 0.0)
        out.update(sketch.to_metrics(base))
    out[ALL + "ms_total"] = sum(totals.values())
    out[ALL + CHECKSUM + "cpu_ms"] = checksum_ms
    return out


def strip_sketches(metrics: dict[str, float]) -> dict[str, float]:
    """Drop the latency histograms (merge material, not something to log) in place; returns `metrics`."""
    for key in [k for k in metrics if "/" + HIST in k]:
        del metrics[key]
    return metrics

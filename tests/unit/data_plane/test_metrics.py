"""Observability: the metered wrapper counts ops, keys, bytes, latency, errors, held and driver bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from relayrl.data_plane import build_data_plane_client
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import MissingKeysError
from relayrl.data_plane.latency import LatencySketch
from relayrl.data_plane.memory import ColumnarStore, MemoryDataPlaneClient
from relayrl.data_plane.metrics import MeteredDataPlaneClient, merge_clients, strip_sketches


def _client(is_driver: bool = True) -> tuple[MeteredDataPlaneClient, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    inner = MemoryDataPlaneClient(ColumnarStore(), verify_checksums=True)
    c = MeteredDataPlaneClient(inner, is_driver=is_driver, on_event=events.append)
    c.register_partition("train", ["x", "ids"], 4, ["t"])
    return c, events


def test_put_get_clear_are_counted_with_bytes_and_keys() -> None:
    c, events = _client()
    c.put_samples(list("abcd"), "train", {"x": torch.zeros(4, dtype=torch.float32)})
    ids = Column(torch.zeros(10, dtype=torch.int64), torch.tensor([1, 2, 3, 4]))
    c.put_samples(list("abcd"), "train", {"ids": ids})
    c.get_samples(["b", "d"], "train", ["x", "ids"])
    assert c.clear_samples(None, "train") == 4
    m = c.metrics()
    assert m["data_plane/put/count"] == 2 and m["data_plane/put/keys"] == 8
    assert m["data_plane/put/bytes"] == 16 + 80 + 32
    assert m["data_plane/get/bytes"] == 8 + (2 + 4) * 8 + 16
    assert m["data_plane/clear/keys"] == 4 and m["data_plane/register/count"] == 1
    assert m["data_plane/driver_bytes"] == m["data_plane/put/bytes"] + m["data_plane/get/bytes"]
    assert m["data_plane/get/ms_max"] >= m["data_plane/get/ms_mean"] > 0
    assert [e["op"] for e in events] == ["register", "put", "put", "get", "clear"]
    assert events[1] == {**events[1], "n_keys": 4, "n_bytes": 16, "status": "ok"}


def test_errors_are_counted_and_reraised() -> None:
    c, events = _client()
    with pytest.raises(MissingKeysError):
        c.get_samples(["nope"], "train", ["x"])
    m = c.metrics()
    assert m["data_plane/get/errors"] == 1 and m["data_plane/get/bytes"] == 0
    assert events[-1]["status"] == "MissingKeysError"


def test_held_bytes_per_partition_and_reset() -> None:
    c, _ = _client(is_driver=False)
    c.register_partition("val", ["x"], 2, ["v"])
    c.put_samples(["a", "b"], "train", {"x": torch.zeros(2, 4, dtype=torch.float64)})
    m = c.metrics(reset=True)
    assert m["data_plane/held_bytes/train"] == 64 and m["data_plane/held_bytes/val"] == 0
    assert m["data_plane/held_bytes_total"] == 64 and m["data_plane/driver_bytes"] == 0  # a worker client
    after = c.metrics()
    assert "data_plane/put/count" not in after and after["data_plane/held_bytes/train"] == 64


def test_factory_clients_are_metered_and_close_twice() -> None:
    c = build_data_plane_client({"enabled": True, "backend": "memory"})
    assert isinstance(c, MeteredDataPlaneClient)
    c.close()
    c.close()
    assert c.metrics()["data_plane/close/count"] == 2


class _Group:
    """A worker group that records calls; `fail` makes the workers' attach step raise."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.calls = fail, []

    def run_all(self, method: Callable[..., Any], *args: Any) -> None:
        self.calls.append(method.__name__)
        if self.fail:
            raise RuntimeError("worker could not attach")

    def shutdown(self) -> bool:
        self.calls.append("shutdown")
        return True


def test_facade_connection_counts_as_driver_and_cleans_up_on_failure() -> None:
    from relayrl.data_plane.factory import close_quietly, connect_driver_and_workers, validate_data_plane_config

    cfg = validate_data_plane_config({"enabled": True, "backend": "memory"})
    group = _Group(fail=False)
    driver = connect_driver_and_workers(group, cfg, bootstrap=True)
    attached = connect_driver_and_workers(group, cfg, bootstrap=False)  # e.g. the critic: attached, in the driver
    assert group.calls == ["setup_data_plane", "setup_data_plane"]
    assert isinstance(attached, MeteredDataPlaneClient) and attached.is_driver
    assert not build_data_plane_client(cfg, bootstrap=False).is_driver  # a worker's own client
    close_quietly(attached)
    close_quietly(driver)
    broken = _Group(fail=True)
    with pytest.raises(RuntimeError, match="could not attach"):
        connect_driver_and_workers(broken, cfg, bootstrap=True)
    assert broken.calls == ["setup_data_plane", "shutdown"]


def test_percentiles_merge_across_clients_and_nested_facades() -> None:
    """A client reports p50/p90 and its histogram; `merge_clients` adds up histograms and seconds over clients, a
    facade's already-merged `all/` part counts once through its own merge, and `strip_sketches` leaves no
    histogram to log."""
    driver, _ = _client()
    worker, _ = _client(is_driver=False)
    critic, _ = _client(is_driver=False)
    for c in (driver, worker, critic):
        c.put_samples(list("abcd"), "train", {"x": torch.zeros(4)})
        c.get_samples(["a"], "train", ["x"])
    d, w, v = driver.metrics(), worker.metrics(), critic.metrics()
    assert d["data_plane/get/ms_p50"] <= d["data_plane/get/ms_p90"] and d["data_plane/checksum/cpu_ms"] > 0
    facade = {**v, **merge_clients([v])}  # a critic facade that merged its own workers
    merged = merge_clients([d, w, facade])
    sketch = LatencySketch()
    for part in (d, w, v):
        sketch.merge(
            LatencySketch.from_metrics((k, x) for k, x in part.items() if k.startswith("data_plane/get/ms_hist/"))
        )
    assert sketch.total == 3 and merged["data_plane/all/get/ms_p90"] == sketch.quantile(0.9)
    assert merged["data_plane/all/put/ms_total"] == pytest.approx(sum(p["data_plane/put/ms_total"] for p in (d, w, v)))
    want = sum(p[f"data_plane/{op}/ms_total"] for p in (d, w, v) for op in ("register", "put", "get"))
    assert merged["data_plane/all/ms_total"] == pytest.approx(want)
    assert merged["data_plane/all/checksum/cpu_ms"] == pytest.approx(
        sum(p["data_plane/checksum/cpu_ms"] for p in (d, w, v))
    )
    out = strip_sketches({**d, **merged})
    assert not [k for k in out if "ms_hist" in k] and "data_plane/all/get/ms_p50" in out

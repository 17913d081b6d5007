"""The contract suite on the `memory` backend, plus what only the columnar store can show (segments, bytes,
attach semantics, the factory)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane import build_data_plane_client
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import DataPlaneClient
from relayrl.data_plane.memory import ColumnarStore, MemoryDataPlaneClient, build_client
from tests.unit.data_plane.contract import CONTRACT_CHECKS
from tests.unit.data_plane.contract_integrity import (
    check_corrupted_row_fails_at_get,
    check_latency_percentiles,
    corrupt_columnar_store,
)


def make_memory_client(storage_capacity: int = 10_000) -> DataPlaneClient:
    return MemoryDataPlaneClient(ColumnarStore(storage_capacity), verify_checksums=True)


def make_factory_client(storage_capacity: int = 10_000) -> DataPlaneClient:
    return build_data_plane_client({"enabled": True, "backend": "memory", "storage_capacity": storage_capacity})


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__)
def test_memory_contract(check: Callable[[Callable[..., DataPlaneClient]], None]) -> None:
    check(make_memory_client)


@pytest.mark.parametrize("check", CONTRACT_CHECKS[:4], ids=lambda c: c.__name__)
def test_contract_through_factory_and_metrics_wrapper(check: Callable[[Callable[..., DataPlaneClient]], None]) -> None:
    check(make_factory_client)


def test_one_segment_per_put_and_segments_freed_when_dead() -> None:
    store = ColumnarStore()
    store.register_partition("p", ["x", "y"], 4, ["t"])
    lens = torch.tensor([3, 1, 2, 4])
    store.put_samples(["a", "b", "c", "d"], "p", {"x": Column(torch.arange(10), lens), "y": torch.zeros(4)})
    fs = store._columns["p"]["x"]
    assert len(fs.segments) == 1 and fs.segments[0].values.shape == (10,)
    # x and y written together with one lengths tensor share offsets (the flat index is built once per get)
    store.put_samples(["b", "d"], "p", {"x": Column(torch.tensor([7, 8, 9, 9, 9]), torch.tensor([1, 4]))})
    assert len(fs.segments) == 2 and fs.segments[0].live == 2
    got = store.get_samples(["d", "a", "b", "c"], "p", ["x"])["x"]
    assert [got.row(i).tolist() for i in range(4)] == [[8, 9, 9, 9], [0, 1, 2], [7], [4, 5]]
    store.clear_samples(["a"], "p")
    assert fs.segments[0].live == 1
    store.put_samples(["c"], "p", {"x": Column(torch.tensor([5, 5]), torch.tensor([2]))})
    assert 0 not in fs.segments  # first segment's rows all overwritten or cleared: freed


def test_bytes_held_tracks_puts_and_clears() -> None:
    store = ColumnarStore()
    store.register_partition("p", ["x"], 2, ["t"])
    store.register_partition("q", ["x"], 2, ["t"])
    store.put_samples(["a", "b"], "p", {"x": torch.zeros(2, 8, dtype=torch.float32)})
    assert store.bytes_held() == {"p": 64, "q": 0}
    store.clear_samples(None, "p")
    assert store.bytes_held() == {"p": 0, "q": 0}


def test_get_of_contiguous_and_scattered_rows_matches_per_row_slices() -> None:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 50, (64,), generator=g)  # includes zero-length rows
    values = torch.randn(int(lens.sum()), 3, generator=g)
    store = ColumnarStore()
    store.register_partition("p", ["v"], 64, ["t"])
    keys = [f"k{i}" for i in range(64)]
    store.put_samples(keys, "p", {"v": Column(values, lens)})
    src = Column(values, lens)
    for order in (list(range(10, 30)), torch.randperm(64, generator=g).tolist()[:40], [5, 5, 2]):
        got = store.get_samples([keys[i] for i in order], "p", ["v"])["v"]
        assert got.lengths is not None and got.lengths.tolist() == lens[order].tolist()
        assert all(torch.equal(got.row(j), src.row(i)) for j, i in enumerate(order))


def test_workers_attach_to_the_driver_store_and_cannot_close_it() -> None:
    cfg = DataPlaneConfig(enabled=True, backend="memory", storage_capacity=100)
    driver = build_client(cfg, bootstrap=True)
    worker = build_client(cfg, bootstrap=False)
    driver.register_partition("p", ["x"], 1, ["t"])
    worker.put_samples(["a"], "p", {"x": torch.tensor([3.0])})
    worker.close()
    assert driver.get_samples(["a"], "p", ["x"])["x"].values.tolist() == [3.0]
    driver.close()
    with pytest.raises(RuntimeError, match="bootstrap=True"):
        build_client(cfg, bootstrap=False)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (None, "missing"),
        ({"enabled": False}, "disabled"),
        ({"enabled": True, "backend": "noop"}, "backend"),
        ({"enabled": True, "storage_capacity": 0}, "storage_capacity"),
        ({"enabled": True, "capacity": 5}, "capacity"),
    ],
)
def test_factory_rejects_bad_configs(cfg: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_data_plane_client(cfg)  # type: ignore[arg-type]


def test_factory_rejects_non_mapping() -> None:
    with pytest.raises(TypeError, match="DataPlaneConfig or a dict"):
        build_data_plane_client(["memory"])  # type: ignore[arg-type]


def _corrupt_memory(client: DataPlaneClient, partition_id: str, key: str, field: str) -> None:
    assert isinstance(client, MemoryDataPlaneClient)
    corrupt_columnar_store(client.store, partition_id, key, field)


def test_memory_corrupted_row_fails_at_get() -> None:
    check_corrupted_row_fails_at_get(make_memory_client, _corrupt_memory)


def test_memory_latency_percentiles() -> None:
    check_latency_percentiles(make_memory_client)


def test_checksums_off_leaves_a_corrupted_row_unchecked() -> None:
    """`data_plane.verify_checksums=false`: no checksum is computed or compared (the switch is honoured)."""
    client = build_client(DataPlaneConfig(enabled=True, verify_checksums=False), bootstrap=True)
    client.register_partition("p", ["x"], 2, ["t"])
    client.put_samples(["a", "b"], "p", {"x": torch.tensor([1.0, 2.0])})
    corrupt_columnar_store(client.store, "p", "a", "x")
    assert client.get_samples(["a"], "p", ["x"])["x"].values.item() != 1.0
    client.close()

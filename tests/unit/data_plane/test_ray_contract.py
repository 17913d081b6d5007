"""The contract suite on the `ray` backend: the columnar store hosted in a named Ray actor.

One store actor serves the whole module; each check's client attaches to it after a `reset` (see
`contract.hosted_store_fixtures`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.interfaces import DataPlaneClient
from tests.unit.data_plane.contract import CONTRACT_CHECKS, hosted_store_fixtures
from tests.unit.data_plane.contract_integrity import check_corrupted_row_fails_at_get, check_latency_percentiles

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

CFG = DataPlaneConfig(enabled=True, backend="ray", storage_capacity=10_000, verify_checksums=True)


owner, make_client = hosted_store_fixtures("relayrl.data_plane.ray_store", CFG)


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__)
def test_ray_contract(check: Callable[[Callable[..., DataPlaneClient]], None], make_client: Callable) -> None:
    check(make_client)


@pytest.mark.parametrize("check", CONTRACT_CHECKS[:4], ids=lambda c: c.__name__)
def test_ray_contract_through_factory(check: Callable, make_client: Callable[..., DataPlaneClient]) -> None:
    from relayrl.data_plane import build_data_plane_client

    def make(storage_capacity: int = 10_000) -> DataPlaneClient:
        make_client(storage_capacity).close()  # resets the shared store
        return build_data_plane_client(CFG, bootstrap=False)

    check(make)


def _corrupt_in_actor(client: DataPlaneClient, partition_id: str, key: str, field: str) -> None:
    """Flip one bit of the row inside the store actor's own `ColumnarStore` (no client call involved)."""
    from relayrl.data_plane.ray_store import RayDataPlaneClient

    assert isinstance(client, RayDataPlaneClient)

    def in_actor(actor: Any, pid: str, k: str, f: str) -> None:  # defined here: shipped to the actor by value
        corrupt = actor.ledger
        row = corrupt._parts[pid].rows[k]
        fs = corrupt._columns[pid][f]
        seg, pos = fs.segments[int(fs.loc_seg[row])], int(fs.loc_pos[row])
        start = pos if seg.offsets is None else int(seg.offsets[pos])
        seg.values[start : start + 1].reshape(-1)[:1].view(torch.uint8)[0] ^= 1

    ray.get(client._actor.__ray_call__.remote(in_actor, partition_id, key, field), timeout=60)


def test_ray_corrupted_row_fails_at_get(make_client: Callable[..., DataPlaneClient]) -> None:
    check_corrupted_row_fails_at_get(make_client, _corrupt_in_actor)


def test_ray_latency_percentiles(make_client: Callable[..., DataPlaneClient]) -> None:
    check_latency_percentiles(make_client)

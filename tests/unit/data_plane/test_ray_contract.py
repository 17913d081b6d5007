"""The contract suite on the `ray` backend: the columnar store hosted in a named Ray actor.

One store actor serves the whole module; each check's client attaches to it after a `reset` (see
`contract.hosted_store_fixtures`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.interfaces import DataPlaneClient
from tests.unit.data_plane.contract import CONTRACT_CHECKS, hosted_store_fixtures

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

CFG = DataPlaneConfig(enabled=True, backend="ray", storage_capacity=10_000)


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

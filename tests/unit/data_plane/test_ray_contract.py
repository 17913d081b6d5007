"""The contract suite on the `ray` backend: the columnar store hosted in a named Ray actor.

One store actor serves the whole module (starting an actor process costs seconds on a 2-core box); each check's
client attaches to it after a `reset`, which gives the check an empty store with the capacity it asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.interfaces import DataPlaneClient
from tests.unit.data_plane.contract import CONTRACT_CHECKS

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

CFG = DataPlaneConfig(enabled=True, backend="ray", storage_capacity=10_000)


@pytest.fixture(scope="module")
def ray_store(ray_cluster: None) -> Iterator[DataPlaneClient]:
    from relayrl.data_plane.ray_store import build_client

    owner = build_client(CFG, bootstrap=True)
    try:
        yield owner
    finally:
        owner.close()


@pytest.fixture
def make_client(ray_store: DataPlaneClient) -> Callable[..., DataPlaneClient]:
    from relayrl.data_plane.ray_store import RayDataPlaneClient, build_client

    def make(storage_capacity: int = 10_000) -> DataPlaneClient:
        assert isinstance(ray_store, RayDataPlaneClient)
        ray_store.reset(storage_capacity)
        return build_client(CFG, bootstrap=False)

    return make


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

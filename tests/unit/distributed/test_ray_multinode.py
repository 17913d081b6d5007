"""`cluster.num_nodes` is a placement (issue 30 item 2), on a multi-node Ray cluster simulated on this machine the
way Ray's own tests do (`ray.cluster_utils.Cluster`: one raylet per node on loopback).

With `num_nodes > 1` each node gets one bundle of `workers_per_node` ranks, on distinct nodes (STRICT_SPREAD), and
`NODE_RANK`/`LOCAL_RANK` follow from the placement. Packing per-rank bundles put both ranks of `num_nodes=2
workers_per_node=1` on one of two 2-CPU nodes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from relayrl.config import ClusterConfig
from tests.unit.distributed.test_ray_executor import ToyWorker

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    """A head without CPUs and two 2-CPU nodes: any rank runs on a worker node, either could hold both ranks."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ranks_of_two_nodes_land_on_two_nodes_with_ranks_from_the_placement(two_nodes: None) -> None:
    from relayrl.distributed.ray_executor import RayWorkerGroup

    group = RayWorkerGroup(ToyWorker, ClusterConfig(executor="ray", num_nodes=2, workers_per_node=1))
    try:
        nodes = [ray.get(a.node_info.remote())["node_id"] for a in group._actors]
        assert len(set(nodes)) == 2, "both ranks were placed on one node"
        envs = group.run_all(ToyWorker.env)
        assert [(e["NODE_RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "0")]
        totals = group.run_all(ToyWorker.total)  # gloo across the two nodes
        assert all(t.tolist() == totals[0].tolist() for t in totals)
    finally:
        group.shutdown()


def test_more_nodes_than_the_cluster_has_are_refused_at_once(two_nodes: None) -> None:
    from relayrl.distributed.ray_executor import RayWorkerGroup

    with pytest.raises(
        ValueError,
        match=r"cluster.num_nodes=3 places \{'CPU': 1.0\} on each of 3 distinct nodes, but the Ray cluster has 2 node",
    ):
        RayWorkerGroup(ToyWorker, ClusterConfig(executor="ray", num_nodes=3, workers_per_node=1))

"""`cluster.num_nodes` is a placement (issue 30 item 2), on a multi-node Ray cluster simulated on this machine the
way Ray's own tests do (`ray.cluster_utils.Cluster`: one raylet per node on loopback).

With `num_nodes > 1` each node gets one bundle of `workers_per_node` ranks, on distinct nodes (STRICT_SPREAD), and
`NODE_RANK`/`LOCAL_RANK` follow from the placement. Packing per-rank bundles put both ranks of `num_nodes=2
workers_per_node=1` on one of two 2-CPU nodes. Colocated generation workers are pinned to their training rank's
node, the store to the driver's, and a node that cannot see the run directory or a model path is named at start-up.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relayrl.config import ClusterConfig
from relayrl.distributed import refit
from tests.unit.distributed.test_ray_executor import ToyWorker

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
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
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ranks_of_two_nodes_land_on_two_nodes_and_colocated_workers_on_their_rank_s_node(two_nodes: Any) -> None:
    from relayrl.distributed.ray_executor import RayWorkerGroup

    cluster = ClusterConfig(executor="ray", num_nodes=2, workers_per_node=1)
    group = RayWorkerGroup(ToyWorker, cluster)
    try:
        nodes = [ray.get(a.node_info.remote())["node_id"] for a in group._actors]
        assert len(set(nodes)) == 2 and group.node_ids == nodes, "both ranks were placed on one node"
        envs = group.run_all(ToyWorker.env)
        assert [(e["NODE_RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "0")]
        assert [e["RELAYRL_NODE_ID"] for e in envs] == nodes
        totals = group.run_all(ToyWorker.total)  # gloo across the two nodes
        assert all(t.tolist() == totals[0].tolist() for t in totals)
        # colocated generation: pinned the other way round (only pinning puts them there), paired by node id
        wanted = list(reversed(nodes))
        generation = RayWorkerGroup(ToyWorker, cluster, node_ids=wanted)
        try:
            gen_envs = generation.run_all(ToyWorker.env)
            assert generation.node_ids == wanted and [e["RELAYRL_NODE_ID"] for e in gen_envs] == wanted
            cpu = __import__("torch").device("cpu")
            tags = {refit.device_ipc_tag(cpu, int(e["LOCAL_RANK"]), e["RELAYRL_NODE_ID"]) for e in envs}
            assert {refit.device_ipc_tag(cpu, int(e["LOCAL_RANK"]), e["RELAYRL_NODE_ID"]) for e in gen_envs} == tags
        finally:
            generation.shutdown()
    finally:
        group.shutdown()


def test_more_nodes_than_the_cluster_has_are_refused_at_once(two_nodes: Any) -> None:
    from relayrl.distributed.ray_executor import RayWorkerGroup

    with pytest.raises(
        ValueError,
        match=r"cluster.num_nodes=3 places \{'CPU': 1.0\} on each of 3 distinct nodes, but the Ray cluster has 2 node",
    ):
        RayWorkerGroup(ToyWorker, ClusterConfig(executor="ray", num_nodes=3, workers_per_node=1))


def test_the_store_runs_on_the_driver_s_node(two_nodes: Any) -> None:
    from ray._private.state import actors

    from relayrl.config import DataPlaneConfig
    from relayrl.data_plane.ray_store import build_client

    client = build_client(DataPlaneConfig(enabled=True, backend="ray"), bootstrap=True)
    try:
        where = actors(client._actor._actor_id.hex())["Address"]["NodeID"]
        assert where == ray.get_runtime_context().get_node_id()  # the head: no CPUs, so only pinning puts it there
    finally:
        client.close()


_HIDE = """
import builtins, os
_hidden = os.environ["HIDDEN_FROM_THIS_NODE"]
_stat, _open = os.stat, builtins.open
def _check(path):
    if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(_hidden):
        raise FileNotFoundError(2, "not on this node", os.fspath(path))
def stat(path, *a, **k):
    _check(path)
    return _stat(path, *a, **k)
def open_(path, *a, **k):
    _check(path)
    return _open(path, *a, **k)
os.stat, builtins.open = stat, open_
"""


def test_a_node_that_cannot_see_the_run_directory_or_the_model_is_named(two_nodes: Any, tmp_path: Path) -> None:
    """A third node whose processes do not see one directory (a `sitecustomize` on its PYTHONPATH hides it): the
    run directory or model path there is refused naming that node; what every node sees passes."""
    from relayrl.distributed.ray_nodes import check_nodes_see

    hidden, shared = tmp_path / "private", tmp_path / "shared"
    (hidden / "model").mkdir(parents=True)
    (shared / "model").mkdir(parents=True)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(_HIDE))
    node = two_nodes.add_node(num_cpus=0, env_vars={"PYTHONPATH": str(site), "HIDDEN_FROM_THIS_NODE": str(hidden)})
    try:
        two_nodes.wait_for_nodes()
        check_nodes_see(shared, {"policy.model_name": str(shared / "model")}, 60)  # every node sees these
        with pytest.raises(ValueError) as refused:
            check_nodes_see(hidden, {"policy.model_name": str(shared / "model")}, 60)
        line = str(refused.value)
        assert "\n" not in line and f"run directory {hidden} is not visible from Ray node" in line
        assert f"node id {node.node_id[:12]}" in line and "storage every node shares" in line
        with pytest.raises(ValueError) as refused:
            check_nodes_see(shared, {"policy.model_name": str(hidden / "model")}, 60)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"policy.model_name {hidden / 'model'} does not exist on Ray node")
        assert f"node id {node.node_id[:12]}" in line
        assert not list(shared.glob(".relayrl-*")) and not list(hidden.glob(".relayrl-*"))  # the token is removed
    finally:
        two_nodes.remove_node(node)

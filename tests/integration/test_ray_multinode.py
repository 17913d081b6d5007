"""Ray across nodes (issue 30 items 2-6), on a multi-node cluster simulated on this machine the way Ray's own tests
do (`ray.cluster_utils.Cluster`: one raylet per node on loopback), one cluster for the module.

With `num_nodes > 1` each node gets one bundle of `workers_per_node` ranks, on distinct nodes (STRICT_SPREAD), and
`NODE_RANK`/`LOCAL_RANK` follow from the placement. Packing per-rank bundles put both ranks of `num_nodes=2
workers_per_node=1` on one of two 2-CPU nodes. Colocated generation workers are pinned to their training rank's
node, the store to the driver's, and a node that cannot see the run directory or a model path is named at start-up.
A node lost mid-step ends GRPO in one line naming its rank and node, and the run resumes exactly on a new cluster,
with generation moved to a node of its own, whose loss ends the run in one line too (the last test: it removes a
node of the module's cluster).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relayrl.cli.main import main
from relayrl.config import ClusterConfig
from relayrl.distributed import refit
from tests.helpers import TWO_NODE_GRPO, metrics_by_step
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


STEPS = 4
OVERRIDES = [*TWO_NODE_GRPO, f"grpo.max_num_steps={STEPS}"]
#: the resumed run's placement: generation on a node of its own (resume-safe: where generation runs is not what it
#: computes)
DEDICATED_GENERATION = [
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.num_nodes=1",
    "policy.generation.colocated.resources.workers_per_node=1",
]
LINE_DEADLINE_S = 20  # from a training node's loss to the run's exit (a clean-up that waited on the lost node: 32 s)
GENERATION_LINE_DEADLINE_S = 40  # a generation node: the refit broadcast finds the lost peer; Ray may take seconds


def _saved(run_dir: Path) -> list[int]:
    """Steps with a published checkpoint (a step's metrics are logged before its checkpoint is written)."""
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def _created_groups() -> list[dict[str, Any]]:
    from ray.util import placement_group_table

    return [g for g in placement_group_table().values() if g["state"] == "CREATED"]


def _lose_a_node_after_step(
    cluster: Any, proc: subprocess.Popen[str], run_dir: Path, step: int, rank0: bool, out: dict[str, Any]
) -> None:
    """Remove a node as soon as `step` is checkpointed, and wait for the run: training rank 0's (bundle 0 of the
    STRICT_SPREAD placement group), or else the node no training rank is on (the dedicated generation worker's)."""
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints").is_dir() or step not in _saved(run_dir):
            if proc.poll() is not None or time.monotonic() > deadline:
                out["unkilled"] = True  # ended or stuck before the loss: reported by the test
                return
            time.sleep(0.1)
        (training,) = [g for g in _created_groups() if g["strategy"] == "STRICT_SPREAD"]
        ranks = training["bundles_to_node_id"]
        if rank0:
            out["victim"] = next(n for n in cluster.worker_nodes if n.node_id == ranks[0])
        else:
            (out["victim"],) = [n for n in cluster.worker_nodes if n.node_id not in set(ranks.values())]
        cluster.remove_node(out["victim"])
        lost_at = time.monotonic()
        out["out"], out["err"] = proc.communicate(timeout=120)
        out["elapsed"] = time.monotonic() - lost_at
    finally:
        if proc.poll() is None:
            proc.kill()
            out["err"] = out.get("err", "") + proc.communicate()[1]


def _one_error_line(killed: dict[str, Any], proc: subprocess.Popen[str], deadline_s: float) -> str:
    """The run's one error line, after checking it ended with exit 1 within `deadline_s` and no traceback."""
    err = killed.get("err", "")
    assert not killed.get("unkilled"), f"the run ended or stalled before the node was lost: {err[-3000:]}"
    assert proc.returncode == 1, err[-3000:]
    assert killed["elapsed"] <= deadline_s, f"the run took {killed['elapsed']:.0f} s to end after the node was lost"
    assert "Traceback" not in err, err[-3000:]
    # the run's line is the last one: the driver leaves Ray first, so none of the raylets' lines about the loss
    # (streamed while the process exits, e.g. "Failed to send wait complete: RpcError") can land below it
    lines = [line for line in err.splitlines() if line.strip()]
    assert [line for line in lines if line.startswith("relayrl: error")] == lines[-1:], err[-3000:]
    return lines[-1]


def _run(run_dir: Path, env: dict[str, str], *overrides: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_lost_nodes_end_grpo_in_one_line_and_the_run_resumes_exactly_on_a_new_cluster(
    two_nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPO with its two ranks (each with its colocated generation worker) on the two nodes, joined through
    RAY_ADDRESS as a `ray job submit` driver would; the node of training rank 0 removed as step 2 starts. The run
    ends within seconds, exit 1, with one line naming the rank and its node and the command that resumes. On a new
    cluster (`cluster.ray_address`) the run resumes with generation moved to a node of its own (both resume-safe),
    logs the metrics of an uninterrupted run on one node (the local executor, same world size: bit-identical to
    Ray's) for the steps it trains, and when that generation node is removed after step 2 it ends in one line naming
    the generation worker and its node. The new cluster and the one-node run are made while the two-node run starts
    (the box waits on Ray's process starts otherwise)."""
    from ray.cluster_utils import Cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run_dir, address = tmp_path / "run", two_nodes.address
    env = dict(os.environ, RAY_ADDRESS=address, RELAYRL_REFIT_IPC_DIR=str(tmp_path))
    proc = _run(run_dir, env, *OVERRIDES)
    killed: dict[str, Any] = {}
    watcher = threading.Thread(target=_lose_a_node_after_step, args=(two_nodes, proc, run_dir, 1, True, killed))
    watcher.start()
    second = None
    try:
        # the new cluster: no CPU on the head, two nodes for the ranks (STRICT_SPREAD), one for generation
        second = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(3):
            second.add_node(num_cpus=1)
        reference = tmp_path / "one_node"
        one_node = ["cluster.executor=local", "cluster.num_nodes=1", "cluster.workers_per_node=2"]
        assert main(["train", "--run-dir", str(reference), *OVERRIDES, *one_node]) == 0
        expected = metrics_by_step(reference, ("train/",))
        assert sorted(expected) == list(range(1, STEPS + 1))
        watcher.join()
        line = _one_error_line(killed, proc, LINE_DEADLINE_S)
        assert line.startswith("relayrl: error: rank 0 ("), line
        assert f"node id {killed['victim'].node_id[:12]}) died during" in line, line
        assert line.endswith(
            f"`RAY_ADDRESS={address} relayrl train --run-dir {run_dir}` resumes from the last checkpoint"
        )
        assert _saved(run_dir) == [1]

        # the new cluster, its address and generation's placement resume-safe overrides
        ray.shutdown()
        second.wait_for_nodes()
        env = dict(os.environ, RELAYRL_REFIT_IPC_DIR=str(tmp_path))
        resumed = _run(run_dir, env, f"cluster.ray_address={second.address}", *DEDICATED_GENERATION)
        lost: dict[str, Any] = {}
        ray.init(address=second.address, log_to_driver=False)  # to read the placement groups
        _lose_a_node_after_step(second, resumed, run_dir, 2, False, lost)
    finally:
        watcher.join()
        ray.shutdown()
        if second is not None:
            second.shutdown()
    line = _one_error_line(lost, resumed, GENERATION_LINE_DEADLINE_S)
    assert f"Resumed from {run_dir / 'checkpoints' / 'step_1'}" in lost["out"] + lost["err"]
    assert line.startswith("relayrl: error: rank 0 (GenerationWorker"), line
    assert f"node id {lost['victim'].node_id[:12]}" in line, line
    assert line.endswith(f"`relayrl train --run-dir {run_dir}` resumes from the last checkpoint"), line
    across = metrics_by_step(run_dir, ("train/",))
    # two nodes, one lost, resumed elsewhere with generation moved: one node's numbers, step for step
    assert {1, 2} <= set(across) <= set(expected)
    assert across == {s: expected[s] for s in across}

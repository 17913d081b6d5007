"""Dedicated generation on a node of its own, and that node lost mid-run (issue 30 items 4 and 6), on a simulated
three-node cluster (`ray.cluster_utils.Cluster`, a CPU-less head and three 1-CPU nodes: two training ranks, one
generation worker). Until step 2 is checkpointed the run trains across the three nodes, logging what one node's
run (the local executor, same world size) logs, bit for bit; then the generation
worker's node is removed: the training ranks' refit broadcast loses its peer, and the run ends within seconds with
one line naming the lost generation worker and its node, and the command that resumes; nothing of Ray's or gloo's
traceback.

Beside the suite (`-m slow`, ~40 s): the suite's 12 minutes have no room for a third simulated cluster; the loss of
a training rank's node, with the exact resume on a new cluster, is in the suite (test_ray_multinode.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.cli.main import main
from tests.helpers import TWO_NODE_GRPO, metrics_by_step

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

OVERRIDES = [
    *TWO_NODE_GRPO,
    "grpo.max_num_steps=4",
    "policy.generation.colocated.enabled=false",  # generation on a node of its own
    "policy.generation.colocated.resources.num_nodes=1",
    "policy.generation.colocated.resources.workers_per_node=1",
]
LINE_DEADLINE_S = 40  # from the node's loss to the run's exit: Ray may take seconds to call a node dead


def test_a_lost_generation_node_ends_the_run_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    proc = None
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        run_dir = tmp_path / "run"
        env = dict(os.environ, RELAYRL_REFIT_IPC_DIR=str(tmp_path), RAY_ADDRESS=cluster.address)
        cmd = [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *OVERRIDES]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 240
        while len(list((run_dir / "checkpoints").glob("step_*"))) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "step 2 was never checkpointed"
            time.sleep(0.1)
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        training = {n for g in groups if g["strategy"] == "STRICT_SPREAD" for n in g["bundles_to_node_id"].values()}
        assert len(training) == 2, groups  # the two ranks on two nodes, generation on the third
        (victim,) = [n for n in nodes if n.node_id not in training]
        cluster.remove_node(victim)
        lost_at = time.monotonic()
        err = proc.communicate(timeout=120)[1]
        elapsed = time.monotonic() - lost_at
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        ray.shutdown()
        cluster.shutdown()
    # the steps trained across three nodes are one node's: the local executor's run of 2 ranks (same schedule)
    one_node = [o for o in OVERRIDES if not o.startswith(("cluster.", "policy.generation.colocated"))]
    local = tmp_path / "one_node"
    assert main(["train", "--run-dir", str(local), *one_node, "cluster.workers_per_node=2"]) == 0
    expected, across = metrics_by_step(local, ("train/",)), metrics_by_step(run_dir, ("train/",))
    assert sorted(expected) == [1, 2, 3, 4] and {1, 2} <= set(across)
    assert {s: across[s] for s in (1, 2)} == {s: expected[s] for s in (1, 2)}
    assert proc.returncode == 1, err[-3000:]
    assert elapsed <= LINE_DEADLINE_S, f"the run took {elapsed:.0f} s to end after the generation node was lost"
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("relayrl: error: rank 0 (GenerationWorker"), err[-3000:]
    assert f"node id {victim.node_id[:12]}" in errors[0], errors[0]
    assert errors[0].endswith(f"relayrl train --run-dir {run_dir}` resumes from the last checkpoint"), errors[0]

"""RayWorkerGroup on a local Ray: rank-ordered dispatch, per-rank env, gloo collectives, failures, clean shutdown.

Starting actor processes costs seconds on a 2-core box, so each test builds as few groups as it can and the
module shares one Ray instance, shut down at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig
from relayrl.distributed.interfaces import Collective, WorkerGroup
from tests.unit.distributed.toy_worker import CollectiveToyWorker

ray = pytest.importorskip("ray")

CLUSTER = ClusterConfig(executor="ray", workers_per_node=2, torch_num_threads=1)


class ToyWorker(CollectiveToyWorker):
    """Holds a rank-dependent tensor; methods exercise the env, every collective and failure paths."""

    def __init__(self, *, rank: int, comm: Collective, scale: float = 1.0) -> None:
        self.rank = rank
        self.comm = comm
        self.value = torch.arange(3, dtype=torch.float32) + 10.0 * (rank + 1) * scale  # [3]

    def env(self) -> dict[str, Any]:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "HF_HUB_OFFLINE")
        keys += ("RELAYRL_NODE_ID",)
        return {**{k: os.environ.get(k) for k in keys}, "threads": torch.get_num_threads(), "pid": os.getpid()}

    def scaled(self, shard: list[int], factor: int = 1) -> list[int]:
        return [factor * x + self.rank for x in shard]

    def sleep_then_total(self, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        return self.total()

    def fail_on(self, bad_rank: int) -> torch.Tensor:
        if self.rank == bad_rank:
            raise ValueError(f"rank {self.rank} failed on purpose")
        return self.total()  # the healthy ranks wait here for a peer that never comes


def nope(worker: ToyWorker) -> None:
    """A function that is no method of ToyWorker: the actors look its name up and fail."""


def make_group(**kwargs: Any) -> Any:
    from relayrl.distributed.ray_executor import RayWorkerGroup

    return RayWorkerGroup(ToyWorker, CLUSTER, scale=kwargs.pop("scale", 1.0), **kwargs)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie has exited already
        return fh.read().split(")")[-1].split()[0] != "Z"


def assert_torn_down(group: Any, run: Any, within_s: float = 30.0) -> None:
    """`run` (run_all or run_rank0) refuses the shut-down group, every rank's process has exited and the placement
    group is removed."""
    with pytest.raises(RuntimeError, match="shut down"):
        run(ToyWorker.total)
    deadline = time.monotonic() + within_s
    while any(pid_alive(p) for p in group.pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in group.pids), "a rank's actor process outlived shutdown"
    table = ray.util.placement_group_table()
    assert table[group.placement_group_id]["state"] == "REMOVED"


@pytest.mark.ray
def test_dispatch_env_collectives_errors_and_shutdown(ray_cluster: None) -> None:
    group = make_group(scale=2.0, error_grace_s=3.0)
    try:
        assert isinstance(group, WorkerGroup) and group.world_size == 2
        envs = group.run_all(ToyWorker.env)
        master = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}
        assert len(master) == 1 and None not in next(iter(master))
        assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["NODE_RANK"]) for e in envs] == [
            ("0", "2", "0", "0"),
            ("1", "2", "1", "0"),
        ]
        assert all(e["threads"] == 1 for e in envs)  # cluster.torch_num_threads applied in each actor
        assert [e["pid"] for e in envs] == group.pids and len(set(group.pids)) == 2 and os.getpid() not in group.pids
        assert envs[0]["HF_HUB_OFFLINE"] == os.environ.get("HF_HUB_OFFLINE")  # driver env forwarded
        assert group.run_sharded(ToyWorker.scaled, [[1, 2], [3]], factor=10) == [[10, 20], [31]]  # rank order
        assert group.run_rank0(ToyWorker.scaled, [5]) == [5]
        with pytest.raises(ValueError, match="3 shards for 2 workers"):
            group.run_sharded(ToyWorker.scaled, [[1], [2], [3]])
        # gloo collectives: rank r holds [0,1,2] + 20(r+1); the sum is identical on both ranks
        expected = torch.tensor([60.0, 62.0, 64.0])
        assert all(torch.equal(t, expected) for t in group.run_all(ToyWorker.total))
        assert all(torch.equal(t, torch.tensor([40.0, 41.0, 42.0])) for t in group.run_all(ToyWorker.take_from, 1))
        assert group.run_all(ToyWorker.gather, "x") == [[(0, "x"), (1, "x")]] * 2
        with pytest.raises(AttributeError, match="no method 'nope'"):
            group.run_all(nope)  # every rank fails at once: the group stays usable
        assert all(torch.equal(t, expected) for t in group.run_all(ToyWorker.total))
        # an error on one rank while the other waits in a collective: re-raised, then the stuck group is torn down
        start = time.monotonic()
        with pytest.raises(ValueError, match="rank 1 failed on purpose"):
            group.run_all(ToyWorker.fail_on, 1)
        assert time.monotonic() - start < 30
        assert_torn_down(group, group.run_all)
    finally:
        group.shutdown()
    assert group.shutdown()  # idempotent


@pytest.mark.ray
@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_killed_rank_is_named_within_bounded_time(ray_cluster: None, how: str) -> None:
    from relayrl.distributed.ray_executor import WorkerDiedError

    group = make_group()
    try:
        ref_start = time.monotonic()
        killer_delay = 2.0

        def kill() -> None:
            if how == "ray.kill":
                ray.kill(group.actor(1), no_restart=True)
            else:
                os.kill(group.pids[1], signal.SIGKILL)

        timer = threading.Timer(killer_delay, kill)
        timer.start()
        with pytest.raises(
            WorkerDiedError,
            match=r"^rank 1 \(ToyWorker, (pid \d+, node [\d.]+|\w+), node id [0-9a-f]{12}\) died during 'sleep_then_total'",
        ):
            group.run_all(ToyWorker.sleep_then_total, 6.0)  # rank 0 ends up blocked in the all-reduce
        timer.join()
        assert time.monotonic() - ref_start < 60
        assert_torn_down(group, group.run_rank0)
    finally:
        group.shutdown()


@pytest.mark.ray
def test_resource_request_beyond_the_cluster_fails_fast(ray_cluster: None) -> None:
    from relayrl.distributed.ray_executor import RayWorkerGroup

    too_big = ClusterConfig(executor="ray", workers_per_node=2, cpus_per_worker=64)
    with pytest.raises(ValueError, match="need 128 CPU but the Ray cluster has"):
        RayWorkerGroup(ToyWorker, too_big)


def test_local_path_never_imports_ray() -> None:
    code = (
        "import sys, torch\n"
        "from relayrl.config import ClusterConfig\n"
        "from relayrl.distributed.executor import build_worker_group\n"
        "class W:\n"
        "    def __init__(self, *, rank, comm, k):\n"
        "        self.rank, self.comm, self.k = rank, comm, k\n"
        "    def total(self):\n"
        "        t = torch.tensor([float(self.rank + self.k)]); self.comm.all_reduce_sum(t); return t.item()\n"
        "g = build_worker_group(W, ClusterConfig(executor='local', workers_per_node=3), k=1)\n"
        "assert g.run_all(W.total) == [6.0] * 3, g.run_all(W.total)\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_torch_collective_rejects_bad_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.distributed.torch_collective import TorchDistCollective, default_backend

    assert default_backend("cpu") == "gloo" and default_backend(torch.device("cuda", 0)) == "nccl"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        TorchDistCollective(2, 2)
    with pytest.raises(ValueError, match=r"needs the environment variable\(s\) \['MASTER_ADDR', 'MASTER_PORT'\]"):
        TorchDistCollective(0, 2)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        TorchDistCollective(0, 2, backend="mpi")


def test_rank_processes_drop_finalizer_tracebacks_of_being_stopped_but_keep_real_ones() -> None:
    """A SystemExit raised inside a `__del__` (Ray's SIGTERM landing in a ZMQ socket's finalizer while a group is torn
    down) prints nothing; any other exception in a finalizer is still reported."""
    script = (
        "from relayrl.distributed.ray_executor import _quiet_stop_in_finalizers\n"
        "_quiet_stop_in_finalizers()\n"
        "class Stopped:\n"
        "    def __del__(self): raise SystemExit(15)\n"
        "class Broken:\n"
        "    def __del__(self): raise ValueError('a real bug')\n"
        "Stopped(); Broken()\n"
    )
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stderr
    assert "ValueError: a real bug" in err
    assert "SystemExit" not in err and err.count("Traceback") == 1

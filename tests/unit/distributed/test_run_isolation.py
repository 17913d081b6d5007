"""Two runs on one host or one Ray cluster cannot collide, and no remote wait is unbounded.

- refit sockets live in a private (0700) directory per run, which every Ray rank of that run is told;
- the Ray data-plane store's actor name is unique to the run (the driver's Ray job), so a second driver on the same
  cluster gets its own store;
- a local Ray that relayrl starts keeps Ray's token authentication on, without writing ~/.ray/auth_token;
- a call on the ranks or on the rollout actor past its deadline (`cluster.call_timeout_s`) ends in one line naming
  the call and the key; the CLI prints it as one line (exit 1).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relayrl.config import ClusterConfig, DataPlaneConfig
from relayrl.distributed import refit
from relayrl.distributed.errors import RemoteTimeoutError

ray = pytest.importorskip("ray")

CFG = DataPlaneConfig(enabled=True, backend="ray", storage_capacity=1_000)
_NO_AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


# ---------------------------------------------------------------------------------------------------- refit sockets
def test_refit_sockets_live_in_a_private_directory_per_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(refit.IPC_DIR_ENV, "")  # as in a fresh driver (restored afterwards)
    first = refit.private_ipc_dir()
    assert os.environ[refit.IPC_DIR_ENV] == first and refit.private_ipc_dir() == first  # one per process
    mode = os.stat(first)
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()
    tag = refit.device_ipc_tag(__import__("torch").device("cpu"), 0)
    address = refit.ipc_address(tag)
    assert address.startswith(f"ipc://{first}/") and address.endswith("-cpu0.sock")
    monkeypatch.setenv(refit.IPC_DIR_ENV, "")  # another run on this host
    second = refit.private_ipc_dir()
    assert second != first and refit.ipc_address(tag) != address
    # a rank on a node without the driver's directory makes it, private
    elsewhere = tmp_path / "node2" / "relayrl-refit-x"
    monkeypatch.setenv(refit.IPC_DIR_ENV, str(elsewhere))
    assert refit.ipc_address(tag).startswith(f"ipc://{elsewhere}/")
    assert stat.S_IMODE(os.stat(elsewhere).st_mode) == 0o700


# ---------------------------------------------------------------------------------------------------- auth
_START = """
import os, sys
import ray
from relayrl.config import ClusterConfig
from relayrl.distributed.ray_placement import ensure_ray
assert ensure_ray(ClusterConfig(executor="ray"))
print(ray.get_runtime_context().gcs_address, os.environ["RAY_AUTH_TOKEN"], flush=True)
sys.stdin.read()
ray.shutdown()
"""
_JOIN = "import ray, sys; ray.init(address=sys.argv[1]); print('joined')"
#: relayrl's own start under RAY_ADDRESS (what `ray job submit` sets for a job's driver): it joins, giving no CPU count
_JOIN_RELAYRL = """
import ray
from relayrl.config import ClusterConfig
from relayrl.distributed.ray_placement import ensure_ray
assert ensure_ray(ClusterConfig(executor="ray", workers_per_node=8))
print("joined", ray.get_runtime_context().gcs_address, ray.cluster_resources()["CPU"])
"""


@pytest.mark.ray
def test_a_local_ray_started_by_relayrl_requires_its_token(tmp_path: Path) -> None:
    """ensure_ray's local cluster runs with token authentication: a client without the token (or with another)
    is refused, one with it joins; the token lives in the run's environment, not in ~/.ray/auth_token. A second
    relayrl start with RAY_ADDRESS pointing at it joins it as it is."""
    env = {k: v for k, v in os.environ.items() if k not in _NO_AUTH} | {"HOME": str(tmp_path)}
    head = subprocess.Popen(
        [sys.executable, "-c", _START], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert head.stdout is not None
        address, token = head.stdout.readline().split()

        def join(code: str = _JOIN, **extra: str) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [sys.executable, "-c", code, address],
                # Ray retries a refused connection for ~20 s; 3 tries are plenty for a cluster that is up (the
                # clients with the right token join within them too)
                env=env | {"RAY_gcs_server_port_wait_time_s": "3"} | extra,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        # the clients side by side: a refused one only fails after Ray's connection retries
        clients = [join(), join(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)]
        clients.append(join(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token))
        clients.append(join(_JOIN_RELAYRL, RAY_ADDRESS=address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token))
        try:
            results = [(c.communicate(timeout=180), c.returncode) for c in clients]
        finally:
            for c in clients:
                if c.poll() is None:
                    c.kill()
                    c.communicate()
        (_, no_token), (_, wrong_token), ((out, err), right_token), ((env_out, env_err), by_env) = results
        assert no_token != 0 and wrong_token != 0
        assert right_token == 0 and "joined" in out, err[-2000:]
        # joined the running cluster (its address, its 4 CPUs), not a new one sized for 8 ranks
        assert by_env == 0 and env_out.split() == ["joined", address, "4.0"], env_err[-2000:]
        assert not (tmp_path / ".ray").exists()
    finally:
        assert head.stdin is not None
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=30)


# ---------------------------------------------------------------------------------------------------- CLI
def test_a_remote_time_out_during_training_is_one_line_exit_1(capsys, tmp_path, monkeypatch) -> None:
    import relayrl.algorithms.setup as setup_mod
    from relayrl.cli.main import main

    def stuck(cfg: Any, run_dir: Path, *args: Any, **kwargs: Any) -> dict[str, object]:
        raise RemoteTimeoutError("PolicyWorker ranks [1] did not finish 'train' within 5s (cluster.call_timeout_s)")

    monkeypatch.setattr(setup_mod, "run_training", stuck)
    code = main(["train", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert err.startswith("relayrl: error: PolicyWorker ranks [1] did not finish 'train' within 5s (cluster.call_")
    assert err.endswith("resumes from the last checkpoint")


# ---------------------------------------------------------------------------------------------------- on Ray
class NapWorker:
    def __init__(self, *, rank: int, comm: Any) -> None:
        self.rank = rank

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


class SlowRollout:
    """Stands in for the hosted rollout actor: its `rollout` never finishes in time."""

    def rollout(self, batch: Any, kwargs: dict[str, Any]) -> Any:
        time.sleep(120)

    def shutdown(self) -> bool:
        return True


@pytest.mark.ray
def test_ranks_learn_the_runs_socket_directory_and_a_stuck_call_times_out(ray_cluster: None) -> None:
    from relayrl.distributed.ray_executor import RayWorkerGroup

    cluster = ClusterConfig(executor="ray", workers_per_node=1, call_timeout_s=1.0)
    group = RayWorkerGroup(NapWorker, cluster)
    try:
        assert group.run_all(NapWorker.env, refit.IPC_DIR_ENV) == [os.environ[refit.IPC_DIR_ENV]]
        assert group.run_all(NapWorker.nap, 0.0) == [0]
        start = time.monotonic()
        with pytest.raises(RemoteTimeoutError) as caught:
            group.run_all(NapWorker.nap, 60.0)
        assert time.monotonic() - start < 20
        assert str(caught.value) == (
            "NapWorker ranks [0] did not finish 'nap' within 1s (cluster.call_timeout_s); group torn down"
        )
    finally:
        group.shutdown()


@pytest.mark.ray
def test_a_stuck_rollout_actor_times_out_naming_the_call(ray_cluster: None) -> None:
    from relayrl.experience.ray_rollout import RayRolloutActor

    handle = object.__new__(RayRolloutActor)  # the driver-side handle's wiring, around a stand-in actor
    handle._ray, handle._actor = ray, ray.remote(num_cpus=0)(SlowRollout).remote()
    handle._start_timeout_s, handle._call_timeout_s, handle._stuck, handle._closed = 60.0, 1.0, False, False
    handle._generation = None  # never touched once a call got stuck
    start = time.monotonic()
    with pytest.raises(RemoteTimeoutError, match=r"^the rollout actor's 'rollout' did not answer within 1s "):
        handle.rollout_to_tq({"rows": 1})
    assert handle.shutdown() and time.monotonic() - start < 20  # killed, not queued behind the stuck call


@pytest.mark.ray
def test_each_run_gets_its_own_data_plane_store_on_a_shared_cluster(ray_cluster: None) -> None:
    """This driver's store and a second driver's (another process joined to the same cluster) coexist under
    names unique to each run; this run's other processes find its store by the same default name."""
    from relayrl.data_plane import ray_store

    job = ray.get_runtime_context().get_job_id()
    mine = ray_store.build_client(CFG, bootstrap=True)
    try:
        assert ray.get_actor(f"{ray_store.ACTOR_NAME}-{job}", namespace="relayrl") is not None
        other_driver = (
            "import ray, sys; from relayrl.config import DataPlaneConfig; from relayrl.data_plane import ray_store\n"
            "ray.init(address=sys.argv[1], log_to_driver=False)\n"
            "c = ray_store.build_client(DataPlaneConfig(enabled=True, backend='ray'), bootstrap=True)\n"
            "print(ray.get_runtime_context().get_job_id(), flush=True); c.close()\n"
        )
        env = {k: v for k, v in os.environ.items() if k not in _NO_AUTH} | {"RAY_AUTH_MODE": "disabled"}
        address = ray.get_runtime_context().gcs_address
        out = subprocess.run(
            [sys.executable, "-c", other_driver, address], env=env, capture_output=True, text=True, timeout=240
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] != job  # the second run's store ran beside this one's

        @ray.remote(num_cpus=0)
        def attach() -> str:  # any process of this run (a worker, the rollout actor) attaches by the default name
            client = ray_store.build_client(CFG, bootstrap=False)
            try:
                return client._actor._ray_actor_id.hex()  # type: ignore[attr-defined]
            finally:
                client.close()

        assert ray.get(attach.remote(), timeout=120) == mine._actor._ray_actor_id.hex()
    finally:
        mine.close()

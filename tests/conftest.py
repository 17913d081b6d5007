"""Shared fixtures. Tests build their own tiny models (seconds) so none depends on network or the hub."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread: the suite shares two cores; oversubscription makes timings erratic, not faster.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`quick` (`bash scripts/test.sh -m quick`, the inner loop): every test outside tests/integration that starts
    no Ray and is neither slow nor GPU-only; the unit tests mirror the package, so it touches every module."""
    for item in items:
        if "integration" not in item.path.parts and not any(item.get_closest_marker(m) for m in ("ray", "slow", "gpu")):
            item.add_marker(pytest.mark.quick)


DEADLINE_VARIABLES = tuple(f"RELAYRL_{kind}_TIMEOUT_S" for kind in ("START", "CALL", "WAIT", "COLLECTIVE"))


def _restoring_deadlines() -> Iterator[None]:
    before = {name: os.environ.get(name) for name in DEADLINE_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _deadlines_stay_with_their_test() -> Iterator[None]:
    """A run's `setup()` writes its `cluster.*` deadlines into the process environment (`deadlines.configure`, so its
    ranks and children inherit them); a test that trains in-process must not hand its deadlines to the next test of
    the same worker process (a leaked 0.2 s collective deadline failed a later refit test under load)."""
    yield from _restoring_deadlines()


@pytest.fixture(autouse=True, scope="module")
def _deadlines_stay_with_their_module() -> Iterator[None]:
    """The same for a module's fixtures that train in-process (set up before any test's own fixtures)."""
    yield from _restoring_deadlines()


@pytest.fixture(scope="session")
def char_tokenizer():
    """The character-level tokenizer the shipped model uses (chat template, pad and eos set)."""
    from relayrl.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, char_tokenizer) -> Path:
    """A random 2-layer Qwen2 + tokenizer saved as a Hugging Face directory (loaded via from_pretrained); the model is
    tests.helpers.build_test_model's."""
    from relayrl.models.tiny import save_tiny_model
    from tests.helpers import build_test_model

    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(path, build_test_model(char_tokenizer), char_tokenizer)
    return path


RAY_HEAD_CPUS = 8  # the most any module declares (`RAY_NUM_CPUS`); Ray uses the count for placement only


#: Ports Ray binds by default whatever else is asked (dashboard, its agent's HTTP port, the client server) and its
#: default worker port range: a head given one of them as its GCS port refuses to start, and two heads would share them.
_RAY_DEFAULT_PORTS = {8265, 52365, 10001, 6379, *range(10002, 20000)}


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports outside Ray's defaults."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _RAY_DEFAULT_PORTS and port not in ports:
            ports.append(port)
    return ports


def _die_with_parent() -> None:
    """The head's `ray start --block` gets SIGTERM if this pytest worker dies, so no cluster outlives the suite."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@pytest.fixture(scope="session")
def _ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Ray head per pytest(-xdist) worker, started at its first Ray module and stopped at the session's end.

    Each module joins it as its own driver (`ray_cluster`), so a module's actors, placement groups and named actors
    end with its job, while the cluster's start (GCS, raylet, prestarted workers: 3-6 s a module) is paid once per
    worker. `ray start --block` stays this process's child, so the cluster's processes are descendants of the test
    process (tests that look for a run's rank processes walk that tree)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    port, agent_port, client_port = _free_ports(3)
    log = tmp_path_factory.mktemp("ray_head") / "head.log"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}"]
    cmd += [f"--num-cpus={RAY_HEAD_CPUS}", "--include-dashboard=false", "--disable-usage-stats"]
    cmd += [f"--dashboard-agent-listen-port={agent_port}", f"--ray-client-server-port={client_port}"]  # per head
    with log.open("w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + 180  # seconds on an idle box; a busy one (the suite's other worker) takes longer
    while "Ray runtime started" not in log.read_text():
        if head.poll() is not None or time.monotonic() > deadline:
            head.kill()
            pytest.fail(f"the test Ray head did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()  # `ray start --block` drains and stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


def _alive_actors() -> list[str]:
    from ray._private import state

    return sorted(a["ActorClassName"] for a in state.actors().values() if a["State"] != "DEAD")


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest, _ray_head: str) -> Iterator[None]:
    """This module's Ray: the worker's head (`_ray_head`) joined as a new driver, disconnected at the module's end,
    which ends the module's job and with it every actor it started. scripts/test.sh runs the suite with `--dist
    loadscope`: a module's tests stay on one worker, so the cluster serves them alone (the other worker has its
    own head). A module starts only once the actors of the one before it are gone: it never shares the cluster
    with another module's leftovers.

    `RAY_NUM_CPUS` in a module says how many logical CPUs it needs (default 4: on 2 cores TransferQueue's actors
    wait forever with fewer); worker logs are kept out of the test output; no token file is written."""
    ray = pytest.importorskip("ray")
    need = getattr(request.module, "RAY_NUM_CPUS", 4)
    assert need <= RAY_HEAD_CPUS, f"RAY_NUM_CPUS={need} is more than the test head's {RAY_HEAD_CPUS} CPUs"
    if ray.is_initialized():  # a driver an earlier module (or the code it tested) left connected
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=_ray_head, log_to_driver=False)
    try:
        leftovers, settle = _alive_actors(), time.monotonic() + 30
        while leftovers and time.monotonic() < settle:  # the previous job's actors end asynchronously
            time.sleep(0.2)
            leftovers = _alive_actors()
        assert not leftovers, f"actors of an earlier test module still alive on the Ray head: {leftovers}"
        yield
    finally:
        ray.shutdown()

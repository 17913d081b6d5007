"""Joining a Ray cluster the way Ray users do: `ray start --head`, then `ray job submit -- relayrl train ...`.

The job's driver runs on the cluster with `RAY_ADDRESS` set by Ray's job manager: relayrl must join that cluster
as it is (no CPU count, which Ray refuses when joining), and the run must land in the run directory it was given.
That the join is to the named cluster and not to a new one is checked in tests/unit/distributed/test_run_isolation.py
(in the default suite, as is the async kill-and-resume test whose driver joins through RAY_ADDRESS); this one is
`slow`: a cluster with a dashboard of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a cluster with a dashboard of its own: ~35-75 s

RAY = str(Path(sys.executable).with_name("ray"))
OVERRIDES = [
    "cluster.executor=ray",
    "cluster.workers_per_node=2",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "policy.generation.max_new_tokens=8",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "logger.progress_bar=false",
    "logger.tensorboard_enabled=false",
]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def head() -> Iterator[tuple[str, dict[str, str]]]:
    """A `ray start --head --block` cluster of its own (every port free, a short temp dir for its sockets); yields
    the job server's address and the environment to talk to it. Stopping the blocking process stops the cluster."""
    temp = tempfile.mkdtemp(prefix="rrjob", dir="/tmp")
    gcs, dash, agent, agent_grpc, env_agent, metrics, client = _free_ports(7)
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    cmd = [RAY, "start", "--head", "--block", "--num-cpus=4", "--disable-usage-stats", "--include-dashboard=true"]
    cmd += ["--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--temp-dir={temp}", f"--port={gcs}"]
    cmd += [f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}"]
    cmd += [f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}"]
    cmd += [f"--metrics-export-port={metrics}", f"--ray-client-server-port={client}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the job server answers once the dashboard is up
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            check = subprocess.run([RAY, "job", "list", "--address", address], env=env, capture_output=True)
            if check.returncode == 0:
                break
            assert time.monotonic() < deadline, "the Ray head's job server did not come up within 120 s"
            time.sleep(1)
        yield address, env
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_relayrl_train_on_the_cluster(head, tmp_path: Path) -> None:
    address, env = head
    run_dir = tmp_path / "run"
    entry = [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *OVERRIDES]
    job = subprocess.run(
        [RAY, "job", "submit", "--address", address, "--", *entry],
        env=env | {"RELAYRL_REFIT_IPC_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in out, out[-3000:]
    assert "num_cpus and num_gpus must not be provided" not in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in r and r["step"] == 1 for r in rows)

"""Issue 6: SIGKILL one Ray worker mid-run -> `relayrl train` ends within 60 s with one line naming the rank (no
hang, no traceback), and starting it again in the same run directory resumes from the last checkpoint.

The killed run joins this module's Ray cluster through RAY_ADDRESS, as a `ray job submit` driver would (a new local
Ray per run cost its start twice), and the resume runs in this process, a driver of the same cluster; the cluster
serves this module alone, so its `_RankHost` processes are the run's ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.cli.main import main

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 4  # 2 training ranks and their 2 colocated generation workers

OVERRIDES = [
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "policy.generation.max_new_tokens=12",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=4",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "checkpointing.save_period=1",
    "logger.progress_bar=false",
    "logger.tensorboard_enabled=false",
    "cluster.executor=ray",
    "cluster.workers_per_node=2",
]


def _processes() -> dict[int, tuple[int, bytes]]:
    """{pid: (parent pid, command line)} of every process visible in /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        out[int(entry.name)] = (int(stat[stat.rindex(")") + 2 :].split()[1]), cmdline)
    return out


def _rank_host_pids(root: int) -> list[int]:
    """Ray actors hosting relayrl ranks (titled `ray::_RankHost...`) started under process `root` (the module's Ray
    was started from this process)."""
    procs = _processes()
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in procs.items() if ppid in frontier} - found
        found |= frontier
    return sorted(pid for pid in found if procs[pid][1].startswith(b"ray::_RankHost"))


def _train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted({int(r["step"]) for r in rows if "train/loss" in r})


def _saved(run_dir: Path) -> list[int]:
    """Steps with a complete (published) checkpoint; a step's metrics are logged before its checkpoint is written."""
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def _train(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, RELAYRL_REFIT_IPC_DIR=str(run_dir.parent), RAY_AUTH_MODE="disabled", RAY_ADDRESS=address)
    cmd = [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds Ray worker processes through /proc")
def test_killed_worker_ends_the_run_naming_the_rank_and_the_next_start_resumes(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    proc = _train(run_dir, *OVERRIDES)
    try:
        deadline = time.monotonic() + 300
        while len(_saved(run_dir)) < 2:  # two steps checkpointed: the run is in step 3 or later
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the Ray run did not reach step 2 in 300 s"
            time.sleep(0.2)
        victims = _rank_host_pids(os.getpid())
        assert len(victims) >= 2, "the run's Ray rank processes were not found"
        os.kill(victims[0], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert elapsed <= 60, f"the run took {elapsed:.0f} s to end after a rank was killed"
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err
    error_lines = [line for line in err.splitlines() if line.startswith("relayrl: error:")]
    assert len(error_lines) == 1 and "rank" in error_lines[0] and "died" in error_lines[0], err[-2000:]
    give_up = time.monotonic() + 20  # the failed run's surviving ranks go with it: no Ray processes left behind
    while any(Path(f"/proc/{pid}").exists() for pid in victims) and time.monotonic() < give_up:
        time.sleep(0.5)
    assert not [pid for pid in victims if Path(f"/proc/{pid}").exists()], "Ray rank processes left behind"
    done = _train_steps(run_dir)
    saved = _saved(run_dir)
    assert saved and saved[-1] >= 2

    # The next start (no overrides: the run's own config) resumes after the last complete checkpoint; in this
    # process, a driver of the module's cluster as the killed one was (a second interpreter's start-up spared)
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(run_dir.parent))
    capfd.readouterr()
    assert main(["train", "--run-dir", str(run_dir)]) == 0
    out, err = capfd.readouterr()
    assert f"Resumed from {run_dir / 'checkpoints' / f'step_{saved[-1]}'}" in out + err
    assert _train_steps(run_dir) == sorted(set(done) | set(range(saved[-1] + 1, 5)))
    assert _train_steps(run_dir)[-1] == 4

"""A Ray actor of the run that dies mid-run ends it with one line naming the actor (issues 30 and 31).

The data-plane store and the rollout actor are SIGKILLed (their processes, as the OOM killer or a lost node would)
as step 2 starts. The run must end with exit 1 and one line naming what died and the command that resumes, never
Ray's traceback, and the clean-up that then fails on the dead actor must not replace that line. The killed-rank
case (a lost node) is tests/integration/test_ray_multinode.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from relayrl.algorithms.grpo_sync import GRPOSyncSteps
from relayrl.cli.main import main
from tests.helpers import EXACT_RUN, metrics_by_step, tiny_grpo_overrides

pytest.importorskip("ray")
pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 4  # the shared `ray_cluster` fixture (tests/conftest.py) reads it


def _descendants_titled(title: bytes) -> list[int]:
    """Processes below this one (the module's Ray: ray.init started it from here) whose title starts with `title`."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                titles[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return [pid for pid in found if titles.get(pid, b"").startswith(title)]


def _run_killing(run_dir: Path, model_dir: Path, title: bytes, monkeypatch: pytest.MonkeyPatch) -> int:
    step = GRPOSyncSteps.step

    def kill_at_step_2(self, batch, index):  # type: ignore[no-untyped-def]
        if index == 2:
            (victim,) = _descendants_titled(title)
            os.kill(victim, signal.SIGKILL)
        return step(self, batch, index)

    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(run_dir.parent))
    with monkeypatch.context() as mp:
        mp.setattr(GRPOSyncSteps, "step", kill_at_step_2)
        return main(["train", "--run-dir", str(run_dir), *OVERRIDES(model_dir)])


def OVERRIDES(model_dir: Path) -> list[str]:  # noqa: N802
    return tiny_grpo_overrides(
        model_dir,
        *EXACT_RUN,
        "grpo.max_num_steps=3",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "grpo.val_at_end=false",
        "checkpointing.save_period=1",
        "cluster.executor=ray",
        "cluster.workers_per_node=1",  # what dies is not a rank: one rank (and its generation worker) to start
        "data_plane.enabled=true",
    )


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the actors' processes through /proc")
@pytest.mark.parametrize(
    ("title", "named"),
    [(b"ray::StoreActor", "data plane register_partition on partition 'train': the actor serving it is gone"),
     (b"ray::_HostedRolloutActor", "the rollout actor died during")],
    ids=["store", "rollout_actor"],
)  # fmt: skip
def test_a_dead_actor_ends_the_run_with_one_line(
    title: bytes, named: str, ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    run_dir = tmp_path / "run"
    code = _run_killing(run_dir, tiny_model_dir, title, monkeypatch)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("relayrl:")]
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and named in lines[0], lines
    assert lines[0].endswith(f"`relayrl train --run-dir {run_dir}` resumes from the last checkpoint")
    # nothing lost: step 1's checkpoint is complete, the resume point (resuming after a lost Ray process is
    # tests/integration/test_ray_multinode.py's)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_1"]
    assert (run_dir / "checkpoints" / "step_1" / "policy" / "weights" / "model.safetensors").is_file()
    assert sorted(metrics_by_step(run_dir, ("train/",))) == [1]

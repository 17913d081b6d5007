"""No checkpoint without its weights is published (issue 30 item 3).

On Ray, policy rank 0 writes the weights and optimizer state on its own node; with a run directory that node does
not share with the driver, the driver used to publish `step_N` without them, and the run failed only at the next
resume. Here rank 0's weight writer is sent elsewhere (another node's disk, as the driver sees it) from step 2 on:
the run must end with one line at step 2, leaving step 1 (complete) as the resume point, and resume from it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.algorithms.runner import CheckpointIncompleteError, check_weights_written
from relayrl.cli.main import main
from relayrl.models.policy.worker import PolicyWorker
from relayrl.utils.config_io import load_config
from tests.helpers import EXACT_RUN, metrics_by_step, tiny_grpo_overrides


def test_a_checkpoint_missing_a_part_is_refused_naming_it(tmp_path: Path) -> None:
    ppo = load_config(None, ["algorithm=ppo"])
    tmp = tmp_path / "tmp_step_3"
    for model in ("policy", "value"):
        (tmp / model / "optimizer").mkdir(parents=True)
        (tmp / model / "optimizer" / "optimizer.pt").write_bytes(b"x")
    (tmp / "policy" / "weights").mkdir()
    (tmp / "policy" / "weights" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointIncompleteError, match=r"step 3 was not published: .*value/weights holds no value"):
        check_weights_written(tmp, ppo)
    (tmp / "value" / "weights").mkdir()
    (tmp / "value" / "weights" / "adapter_model.safetensors").write_bytes(b"x")  # LoRA adapters count as weights
    check_weights_written(tmp, ppo)
    (tmp / "value" / "optimizer" / "optimizer.pt").unlink()
    with pytest.raises(CheckpointIncompleteError, match="holds no value optimizer"):
        check_weights_written(tmp, ppo)
    check_weights_written(tmp, load_config(None, ["algorithm=ppo", "checkpointing.save_optimizer=false"]))


def test_weights_written_where_the_driver_cannot_see_end_the_run_before_publishing(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, elsewhere = tmp_path / "run", tmp_path / "other_node"
    overrides = tiny_grpo_overrides(tiny_model_dir, *EXACT_RUN, "grpo.max_num_steps=3", "grpo.val_at_start=false")
    overrides += ["checkpointing.save_period=1"]
    save = PolicyWorker._save_weights
    calls = []

    def on_another_node(self: PolicyWorker, weights_path: str) -> None:
        calls.append(weights_path)
        target = weights_path if len(calls) == 1 else str(elsewhere / Path(weights_path).relative_to(tmp_path))
        save(self, target)

    with monkeypatch.context() as mp:
        mp.setattr(PolicyWorker, "_save_weights", on_another_node)
        code = main(["train", "--run-dir", str(run_dir), *overrides])
    full = capsys.readouterr().err
    err = [line for line in full.splitlines() if line.startswith("relayrl:")]  # beside transformers' progress bars
    assert code == 1 and len(err) == 1 and "Traceback" not in full, full[-2000:]
    assert err[0].startswith("relayrl: error: checkpoint step 2 was not published: ")
    assert "policy/weights holds no policy weights" in err[0] and "storage that every node" in err[0]
    assert err[0].endswith(f"`relayrl train --run-dir {run_dir}` resumes from the last checkpoint")
    published = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert published == ["step_1"] and (elsewhere / "run" / "checkpoints" / "tmp_step_2").is_dir()
    # the resume starts from step 1, the last complete checkpoint, and finishes the run
    assert main(["train", "--run-dir", str(run_dir)]) == 0
    assert sorted(metrics_by_step(run_dir, ("train/",))) == [1, 2, 3]

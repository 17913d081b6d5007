"""Exact resume: a run SIGKILLed after a checkpoint and restarted logs the same per-step metrics as an uninterrupted
run with the same seed (CPU, deterministic mode)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.cli.main import main
from tests.helpers import EXACT_RUN, metrics_by_step, sigkill_after_checkpoint, tiny_grpo_overrides

STEPS = 4


RUN = (*EXACT_RUN, f"grpo.max_num_steps={STEPS}", "grpo.val_at_start=false", "checkpointing.save_period=2")


def _train_metrics(run_dir: Path) -> dict[int, dict]:
    """Last logged train/validation metrics per step (a killed run may have logged a step twice)."""
    return metrics_by_step(run_dir, ("train/", "validation/"), skip=("per_sec", "bytes", "fraction"))


@pytest.mark.parametrize("data_plane", ["false", "true"], ids=["legacy", "data_plane"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, tiny_model_dir, data_plane):
    overrides = tiny_grpo_overrides(tiny_model_dir, *RUN, f"data_plane.enabled={data_plane}")
    ref_dir = tmp_path / "uninterrupted"
    assert main(["train", "--run-dir", str(ref_dir), *overrides]) == 0
    reference = _train_metrics(ref_dir)
    assert sorted(reference) == list(range(1, STEPS + 1))

    run_dir = tmp_path / "killed"
    argv = ["-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides]
    sigkill_after_checkpoint(argv, run_dir / "checkpoints" / "step_2")
    assert not (run_dir / "checkpoints" / f"step_{STEPS}").exists()

    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    resumed = _train_metrics(run_dir)
    for step in range(3, STEPS + 1):
        assert resumed[step] == reference[step], f"step {step} differs after resume"

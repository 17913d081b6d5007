"""`checkpointing.save_data_plane=true` on the sync data-plane GRPO trainer: every checkpoint holds the store in
step_N/data_plane/, a resume loads it, and the resumed run's metrics equal an uninterrupted run's."""

from __future__ import annotations

from pathlib import Path

from relayrl.cli.main import main
from tests.helpers import metrics_rows, tiny_grpo_overrides


def _run(run_dir: Path, model_dir: Path, steps: int) -> None:
    overrides = tiny_grpo_overrides(
        model_dir,
        f"grpo.max_num_steps={steps}",
        "checkpointing.save_period=2",
        "cluster.deterministic=true",
        "data_plane.enabled=true",
        "checkpointing.save_data_plane=true",
    )
    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in metrics_rows(run_dir) if "train/loss" in r}


def test_store_checkpointed_and_resume_exact(tmp_path: Path, tiny_model_dir: Path) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run(whole, tiny_model_dir, 3)
    _run(resumed, tiny_model_dir, 2)
    step_2 = resumed / "checkpoints" / "step_2" / "data_plane"
    assert (step_2 / "manifest.json").is_file() and (step_2 / "store.safetensors").is_file()
    _run(resumed, tiny_model_dir, 3)
    assert (resumed / "checkpoints" / "step_3" / "data_plane" / "manifest.json").is_file()
    assert _losses(resumed) == _losses(whole)

"""Exact resume: a run SIGKILLed after a checkpoint and restarted logs the same per-step metrics as an uninterrupted
run with the same seed (CPU, deterministic mode)."""

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

STEPS = 4


def _overrides(model_dir: Path) -> list[str]:
    return [
        f"policy.model_name={model_dir}",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.generation.max_new_tokens=8",
        "policy.optimizer.kwargs.lr=1e-3",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        f"grpo.max_num_steps={STEPS}",
        "grpo.val_period=2",
        "grpo.val_at_start=false",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        "checkpointing.save_period=2",
        "logger.progress_bar=false",
        "logger.tensorboard_enabled=false",
        "cluster.deterministic=true",
        "cluster.torch_num_threads=1",
    ]


def _train_metrics(run_dir: Path) -> dict[int, dict]:
    """Last logged train/validation metrics per step (a killed run may have logged a step twice)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        keep = {
            k: v
            for k, v in row.items()
            if k.startswith(("train/", "validation/")) and not any(x in k for x in ("per_sec", "bytes", "fraction"))
        }
        if keep:
            out.setdefault(row["step"], {}).update(keep)
    return out


@pytest.mark.parametrize("data_plane", ["false", "true"], ids=["legacy", "data_plane"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, tiny_model_dir, data_plane):
    overrides = [*_overrides(tiny_model_dir), f"data_plane.enabled={data_plane}"]
    ref_dir = tmp_path / "uninterrupted"
    assert main(["train", "--run-dir", str(ref_dir), *overrides]) == 0
    reference = _train_metrics(ref_dir)
    assert sorted(reference) == list(range(1, STEPS + 1))

    run_dir = tmp_path / "killed"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (run_dir / "checkpoints" / "step_2").is_dir():
        assert proc.poll() is None, "training process ended before its first checkpoint"
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (run_dir / "checkpoints" / f"step_{STEPS}").exists()

    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    resumed = _train_metrics(run_dir)
    for step in range(3, STEPS + 1):
        assert resumed[step] == reference[step], f"step {step} differs after resume"

"""Runs that meet trouble end cleanly: a NaN reward stops the run before any weight changes (or is skipped),
SIGINT / SIGTERM finish the step, checkpoint it and exit 130 / 143, and the resumed run logs exactly the metrics of
an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.setup import run_training
from relayrl.algorithms.trainer_common import NonFiniteError
from relayrl.cli.main import main
from relayrl.config import EnvConfig
from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from relayrl.environments.registry import ENV_REGISTRY, create_env
from relayrl.utils.config_io import load_config
from tests.helpers import EXACT_RUN, metrics_by_step, tiny_grpo_overrides

ROWS = 16  # 4 prompts x 4 generations
NAN_STEP = 2


def _overrides(model_dir: Path, steps: int) -> list[str]:
    return tiny_grpo_overrides(
        model_dir,
        *EXACT_RUN,
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "checkpointing.save_period=1",
    )


class NanOnceEnv(EnvironmentInterface):
    """The math verifier, except that row 5 of the `NAN_STEP`-th training batch is scored NaN."""

    def __init__(self, cfg: EnvConfig) -> None:
        self.inner, self.train_calls = create_env("math", cfg), 0

    def step(self, message_log_batch: list, metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        out = self.inner.step(message_log_batch, metadata)
        if len(message_log_batch) == ROWS:  # a training batch (validation batches hold 8 rows)
            self.train_calls += 1
            if self.train_calls == NAN_STEP:
                rewards = out.rewards.clone()
                rewards[5] = float("nan")
                return out._replace(rewards=rewards)
        return out


@pytest.fixture
def nan_env() -> Iterator[str]:
    ENV_REGISTRY["nan_once"] = NanOnceEnv
    yield "nan_once"
    del ENV_REGISTRY["nan_once"]


def _metrics(run_dir: Path, prefix: tuple[str, ...] = ("train/", "validation/")) -> dict[int, dict]:
    return metrics_by_step(run_dir, prefix, skip=("per_sec", "bytes", "fraction"))


@pytest.mark.parametrize("data_plane", ["false", "true"], ids=["legacy", "data_plane"])
def test_nan_reward_stops_before_any_weight_changes(tmp_path, tiny_model_dir, nan_env, data_plane):
    cfg = load_config(
        None, [*_overrides(tiny_model_dir, 4), f"data.train.default_task={nan_env}", f"data_plane.enabled={data_plane}"]
    )
    with pytest.raises(NonFiniteError, match=rf"non-finite reward at step {NAN_STEP} in 1 sample\(s\) \(rows 5\)"):
        run_training(cfg, tmp_path / "run")
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == [f"step_{NAN_STEP - 1}"]  # the bad step wrote nothing; the good one before it is intact
    assert sorted(_metrics(tmp_path / "run")) == [NAN_STEP - 1]


def test_nan_reward_skip_mode_drops_the_group_and_counts_it(tmp_path, tiny_model_dir, nan_env):
    cfg = load_config(
        None, [*_overrides(tiny_model_dir, 3), f"data.train.default_task={nan_env}", "grpo.non_finite=skip"]
    )
    run_training(cfg, tmp_path / "run")
    metrics = _metrics(tmp_path / "run")
    assert metrics[NAN_STEP]["train/non_finite_samples_skipped"] == 4.0  # row 5's whole group of 4
    assert all("train/non_finite_samples_skipped" not in metrics[s] for s in (1, 3))
    assert all(torch.isfinite(torch.tensor(metrics[s]["train/loss"])) for s in (1, 2, 3))
    assert torch.isfinite(torch.tensor(metrics[NAN_STEP]["train/reward"]))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"training ended before {path.name} appeared"
        assert time.time() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)


def _signal_run(run_dir: Path, overrides: list[str], wait_for: str, sig: int) -> tuple[int, str]:
    """Start `relayrl train`, send `sig` once `run_dir/wait_for` exists, return (exit code, stderr)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(run_dir / wait_for, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _stopped_after(err: str, name: str) -> int:
    """The step a signalled run stopped after, from its one line (which must also say how to resume)."""
    lines = [ln for ln in err.splitlines() if ln.startswith("relayrl: interrupted")]
    assert len(lines) == 1 and f"by {name} after step" in lines[0] and "checkpoint saved" in lines[0], err
    assert "resumes" in lines[0] and "Traceback" not in err, err
    return int(lines[0].split("after step ")[1].split(",")[0])


def test_sigint_then_sigterm_then_exact_resume(tmp_path, tiny_model_dir):
    steps = 12  # room for the second signal after the first, however late the first one lands
    overrides = [*_overrides(tiny_model_dir, steps), "checkpointing.save_period=100"]
    ref_dir = tmp_path / "uninterrupted"
    assert main(["train", "--run-dir", str(ref_dir), *overrides]) == 0
    reference = _metrics(ref_dir)

    # save_period=100: every checkpoint before the end is one a signal wrote; validation files mark progress
    run_dir = tmp_path / "interrupted"
    code, err = _signal_run(run_dir, overrides, "val_data_step2.jsonl", signal.SIGINT)
    assert code == 130, err
    first = _stopped_after(err, "SIGINT")
    assert (run_dir / "checkpoints" / f"step_{first}").is_dir()

    assert first < steps - 2, f"the first signal landed only after step {first}"
    code, err = _signal_run(run_dir, overrides, f"val_data_step{2 * (first // 2 + 1)}.jsonl", signal.SIGTERM)
    assert code == 143, err
    second = _stopped_after(err, "SIGTERM")
    assert first < second <= steps and (run_dir / "checkpoints" / f"step_{second}").is_dir(), (first, second)

    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    resumed = _metrics(run_dir)
    assert sorted(resumed) == sorted(reference)
    for step in sorted(reference):
        assert resumed[step] == reference[step], f"step {step} differs after SIGINT/SIGTERM and resume"


def test_resume_with_overrides_keeps_the_run_config_and_refuses_inexact_changes(tmp_path, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    first = [*_overrides(tiny_model_dir, 2), "grpo.seed=7", "grpo.max_val_samples=4", "grpo.val_batch_size=4"]
    assert main(["train", "--run-dir", str(run_dir), *first]) == 0
    capsys.readouterr()

    # only the new overrides on the command line: the rest comes from run_dir/config.yaml, not the defaults
    assert main(["train", "--run-dir", str(run_dir), "grpo.max_num_steps=3"]) == 0
    err = capsys.readouterr().err
    assert "relayrl: resuming with grpo.max_num_steps: 2 -> 3" in err
    recorded = load_config(run_dir / "config.yaml")
    assert recorded.grpo.seed == 7 and recorded.grpo.num_prompts_per_step == 4 and recorded.grpo.max_num_steps == 3
    assert sorted(_metrics(run_dir)) == [1, 2, 3]

    for override, key in [
        ("grpo.seed=8", "grpo.seed"),
        ("grpo.num_prompts_per_step=8", "grpo.num_prompts_per_step"),
        ("policy.optimizer.kwargs.lr=0.5", "policy.optimizer.kwargs.lr"),
    ]:
        assert main(["train", "--run-dir", str(run_dir), "grpo.max_num_steps=4", override]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"relayrl: error: {key} ") and "resum" in lines[0], lines
    assert load_config(run_dir / "config.yaml").grpo.seed == 7  # a refused resume rewrote nothing

    # an explicit flag lets an exactness-breaking change through, and it is printed
    assert (
        main(["train", "--run-dir", str(run_dir), "--allow-inexact-resume", "grpo.max_num_steps=4", "grpo.seed=8"]) == 0
    )
    assert "relayrl: resuming with grpo.seed: 7 -> 8" in capsys.readouterr().err
    assert load_config(run_dir / "config.yaml").grpo.seed == 8


class InterruptDuringValidation(EnvironmentInterface):
    """The math verifier, which also sends this process SIGINT while it scores the step-2 validation batch (the
    moment a signal used to arrive after the step tail had decided not to checkpoint)."""

    def __init__(self, cfg: EnvConfig) -> None:
        self.inner, self.train_calls = create_env("math", cfg), 0

    def step(self, message_log_batch: list, metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        if len(message_log_batch) == ROWS:
            self.train_calls += 1
        elif self.train_calls == 2:  # the validation after step 2, inside the step tail
            os.kill(os.getpid(), signal.SIGINT)
        return self.inner.step(message_log_batch, metadata)


def test_a_signal_during_the_step_tail_still_checkpoints_that_step(tmp_path, tiny_model_dir):
    from relayrl.utils.signals import TrainingInterrupted

    ENV_REGISTRY["interrupt_in_val"] = InterruptDuringValidation
    try:
        cfg = load_config(
            None,
            [
                *_overrides(tiny_model_dir, 6),
                "checkpointing.save_period=100",
                "data.train.default_task=interrupt_in_val",
                "data.validation.default_task=interrupt_in_val",
            ],
        )
        with pytest.raises(TrainingInterrupted) as info:
            run_training(cfg, tmp_path / "run")
    finally:
        del ENV_REGISTRY["interrupt_in_val"]
    assert info.value.step == 2 and info.value.saved
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()

"""Refit faults end to end: a run stops in the step the fault happens, with one line and the command that resumes.

Asynchronous GRPO whose generation process loses a tensor of a refit (the trainer-side staging copy skips it), and
a synchronous run whose generation-vs-training log-prob error crosses `policy.generation.logprob_error_bound`
(bf16 generation against float32 training with a bound below what that costs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.models.generation import process_generation
from tests.helpers import tiny_grpo_overrides

Q0 = "model.layers.0.self_attn.q_proj.weight"


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("relayrl: error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_async_producer_refit_that_loses_a_tensor(tiny_model_dir, tmp_path, capsys, monkeypatch):
    real_write = process_generation._Staging.write
    monkeypatch.setattr(
        process_generation._Staging, "write", lambda self, s: real_write(self, {k: v for k, v in s.items() if k != Q0})
    )
    run = tmp_path / "run"
    overrides = tiny_grpo_overrides(
        tiny_model_dir, "grpo.async_grpo.enabled=true", "grpo.max_num_steps=3", "grpo.val_period=0"
    )
    assert main(["train", "--run-dir", str(run), *overrides]) == 1
    line = error_line(capsys)
    assert f"refit verification failed: '{Q0}' on the producer's generation is not the trainer's" in line
    assert "after the snapshot load to weights_version 1" in line
    assert f"`relayrl train --run-dir {run}` resumes" in line


def test_logprob_error_over_its_bound_fails_the_step(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    overrides = tiny_grpo_overrides(
        tiny_model_dir,
        "policy.precision=bfloat16",
        "policy.generation.logprob_error_bound=1.00001",
        "grpo.max_num_steps=2",
        "grpo.val_period=0",
    )
    assert main(["train", "--run-dir", str(run), *overrides]) == 1
    line = error_line(capsys)
    assert "generation and training disagree at step 1: token_mult_prob_error 1.0" in line
    assert "above policy.generation.logprob_error_bound=1.00001" in line
    logged = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in logged if "train/token_mult_prob_error" in r]
    assert steps == [1]  # the step is logged (its value is the evidence) and nothing after it ran
    assert not list(Path(run / "checkpoints").glob("step_*"))  # the failed step is not a resume point

"""End to end on CPU: a short `relayrl train policy.precision=bfloat16` on the shipped model (bf16 training under
autocast, bf16 generation from the refreshed copy): finite updates and a small generation-vs-training mismatch."""

from __future__ import annotations

import math

from relayrl.cli.main import main
from tests.helpers import metrics_by_step


def test_three_bf16_grpo_steps_on_the_shipped_model(tmp_path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        "policy.precision=bfloat16",
        "grpo.max_num_steps=3",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
    ]
    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [1, 2, 3]
    for m in steps.values():
        assert math.isfinite(m["train/loss"]) and 0 < m["train/grad_norm"] < 1e3
        # generation (bf16 copy, bf16 cache) vs the training forward (autocast): 1.0 is perfect agreement; the
        # float32 run logs 1.0 to float rounding, bf16 about 1.001 (README, "Precision")
        assert 1.0 < m["train/token_mult_prob_error"] < 1.01
        assert 0 <= m["train/gen_kl_error"] < 1e-3

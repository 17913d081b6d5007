"""End to end on CPU: `relayrl train` for 3 GRPO steps on a tiny random model, then resume, plot, evaluate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relayrl.cli.main import main


def _tiny_overrides(model_dir: Path, steps: int) -> list[str]:
    return [
        f"policy.model_name={model_dir}",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.generation.max_new_tokens=8",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=2",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        "checkpointing.save_period=2",
        "logger.progress_bar=false",
        "cluster.deterministic=true",
    ]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("data_plane", ["false", "true"], ids=["legacy", "data_plane"])
def test_three_grpo_steps_then_resume_plot_evaluate(tmp_path, tiny_model_dir, capsys, data_plane):
    run_dir = tmp_path / "run"
    dp = [f"data_plane.enabled={data_plane}"]
    assert main(["train", "--run-dir", str(run_dir), *_tiny_overrides(tiny_model_dir, 3), *dp]) == 0
    rows = _metrics(run_dir)
    train_steps = sorted({r["step"] for r in rows if "train/loss" in r})
    assert train_steps == [1, 2, 3]
    for r in rows:
        if "train/loss" in r:
            assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
            assert 0.0 <= r["train/reward"] <= 1.0
    val_steps = sorted(r["step"] for r in rows if "validation/accuracy" in r)
    assert val_steps == [0, 2, 3]  # val_at_start, periodic, val_at_end
    assert (run_dir / "config.yaml").is_file()
    assert any((run_dir / "tensorboard").iterdir())
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts[-1] == "step_3"
    assert (run_dir / "checkpoints" / "step_3" / "policy" / "weights" / "config.json").is_file()

    # Resume in the same run directory with a higher step budget: continues at step 4.
    assert main(["train", "--run-dir", str(run_dir), *_tiny_overrides(tiny_model_dir, 4), *dp]) == 0
    steps_after = sorted({r["step"] for r in _metrics(run_dir) if "train/loss" in r})
    assert steps_after == [1, 2, 3, 4]

    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "metrics.png").stat().st_size > 10_000

    capsys.readouterr()
    ckpt = run_dir / "checkpoints" / "step_4"
    assert main(["evaluate", "--checkpoint", str(ckpt)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= out["accuracy"] <= 1.0 and out["num_samples"] == 8


def test_default_step_moves_at_most_two_percent_of_store_bytes_through_the_driver(tmp_path):
    """Issue 5: on the default config the data-plane step sends per-row scalars (and a few sample texts) to the
    driver, <= 2% of what it writes to the store; the legacy step moves the whole training batch through it."""
    common = ["grpo.max_num_steps=1", "grpo.val_at_start=false", "grpo.val_at_end=false", "logger.progress_bar=false"]
    rows = {}
    for dp in ("true", "false"):
        run_dir = tmp_path / f"dp_{dp}"
        assert main(["train", "--run-dir", str(run_dir), *common, f"data_plane.enabled={dp}"]) == 0
        rows[dp] = next(r for r in _metrics(run_dir) if "train/driver_bytes" in r)
    dp_row, legacy_row = rows["true"], rows["false"]
    assert dp_row["train/driver_fraction_of_store_bytes"] <= 0.02
    assert dp_row["train/driver_bytes"] == pytest.approx(
        dp_row["train/driver_fraction_of_store_bytes"] * dp_row["train/store_bytes_written"]
    )
    assert dp_row["train/driver_bytes"] < 0.05 * legacy_row["train/driver_bytes"]
    assert dp_row["train/reward"] == legacy_row["train/reward"]  # the same step, only data movement differs

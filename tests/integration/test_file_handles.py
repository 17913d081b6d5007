"""A long, validation-heavy run stays within a small open-file limit: every validation writes a new
val_data_step<N>.jsonl, and the logger must not keep them all open."""

from __future__ import annotations

import resource
import subprocess
import sys

STEPS, LIMIT = 60, 48  # one validation file per step: more files than the limit allows handles


def test_validation_every_step_under_a_file_handle_limit(tmp_path):
    def limit_handles() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))

    run_dir = tmp_path / "run"
    args = [
        f"grpo.max_num_steps={STEPS}",
        "grpo.val_period=1",
        "grpo.max_val_samples=4",
        "grpo.val_batch_size=4",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8",
        "logger.progress_bar=false",
        "checkpointing.enabled=false",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *args],
        preexec_fn=limit_handles,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list(run_dir.glob("val_data_step*.jsonl"))) == STEPS + 1  # step 0 and every step after

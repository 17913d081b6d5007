"""The synchronous data-plane trainer on CUDA in bf16 (issue 27): a run is deterministic under
`cluster.deterministic=true`, its checkpoint holds finite weights, and a run SIGKILLed after its step-2 checkpoint and resumed logs
the uninterrupted run's numbers at every step. `gpu`-marked: run on a lent GPU by `scripts/gpu_check.sh`; the same
checks run on CPU in the suite's resume and determinism tests.

`check_runs(device)` is the whole check, so that its plumbing can be tried on a CPU (`python -c 'from
tests.integration.test_gpu_runs import check_runs; check_runs("cpu", ...)'`) before device time is spent.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relayrl.cli.main import main
from tests.helpers import EXACT_RUN, metrics_by_step, sigkill_after_checkpoint, tiny_grpo_overrides

STEPS = 4
SKIP = ("per_sec", "bytes", "fraction", "timing", "latency")  # clocks and rates


def _overrides(model: Path, device: str, *extra: str) -> list[str]:
    return tiny_grpo_overrides(
        model,
        *EXACT_RUN,
        "policy.model_name=builtin:tiny-arith",  # the shipped model: it earns rewards, so updates are not zero
        "policy.precision=bfloat16",
        f"cluster.device={device}",
        "policy.generation.max_new_tokens=16",
        "grpo.val_at_start=false",
        "grpo.val_period=2",
        "checkpointing.save_period=2",
        f"grpo.max_num_steps={STEPS}",
        *extra,
    )


def _train(run_dir: Path, model: Path, device: str) -> dict[int, dict]:
    assert main(["train", "--run-dir", str(run_dir), *_overrides(model, device)]) == 0
    return metrics_by_step(run_dir, ("train/", "validation/"), skip=SKIP)


def check_runs(device: str, root: Path, model: Path) -> None:
    full = _train(root / "a", model, device)
    assert sorted(s for s, m in full.items() if "train/loss" in m) == list(range(1, STEPS + 1))
    assert any(full[s]["train/grad_norm"] > 0 for s in full if "train/grad_norm" in full[s])
    assert _train(root / "b", model, device) == full, "not deterministic"
    weights = load_file(str(root / "a" / "checkpoints" / f"step_{STEPS}" / "policy" / "weights" / "model.safetensors"))
    assert all(torch.isfinite(t.float()).all() for t in weights.values())
    killed = root / "killed"  # SIGKILLed as its step-2 checkpoint is published, then started again
    argv = ["-m", "relayrl.cli.main", "train", "--run-dir", str(killed), *_overrides(model, device)]
    sigkill_after_checkpoint(argv, killed / "checkpoints" / "step_2")
    assert _train(killed, model, device) == full, "the resumed run differs from the uninterrupted one"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bf16_run_on_cuda_is_deterministic_checkpoints_and_resumes_exactly(tmp_path, tiny_model_dir):
    check_runs("cuda", tmp_path, tiny_model_dir)

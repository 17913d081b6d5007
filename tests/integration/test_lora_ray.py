"""LoRA on both executors: the same 3-step LoRA GRPO run in-process (1 worker, colocated engine on the merged view)
and on Ray (2 policy ranks, one actor each, generation workers refitted with the merged weights over ZMQ IPC; the
gradients summed by the manual all-reduce or by DDP) logs the same per-step metrics up to float rounding of the
2-rank gradient sum; checkpoints hold adapters alone."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from relayrl.algorithms.setup import run_training
from relayrl.models.policy import lora
from relayrl.utils.config_io import load_config

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 6  # the shared `ray_cluster` fixture (tests/conftest.py) reads it

TOL = 1e-4
COMPARED = ("train/reward", "train/loss", "train/kl_penalty", "train/grad_norm", "validation/accuracy")


def _overrides(executor: str, workers: int, strategy: str = "manual") -> list[str]:
    return [
        f"policy.data_parallel.strategy={strategy}",
        "policy.lora.enabled=true",
        "policy.lora.rank=4",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=4",
        "policy.generation.max_new_tokens=12",
        "policy.optimizer.kwargs.lr=1e-2",
        "loss_fn.reference_policy_kl_penalty=0.05",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=3",
        "grpo.val_period=3",
        "grpo.max_val_samples=4",
        "grpo.val_batch_size=4",
        "checkpointing.save_period=3",
        "logger.progress_bar=false",
        "logger.tensorboard_enabled=false",
        "logger.num_train_samples_to_log=0",
        f"cluster.executor={executor}",
        f"cluster.workers_per_node={workers}",
        "cluster.deterministic=true",
    ]


def _per_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    by_step: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(int(row["step"]), {}).update(row)
    return by_step


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora_local") / "run"
    run_training(load_config(None, _overrides("local", 1)), run_dir)
    return run_dir


@pytest.mark.parametrize("strategy", ["manual", "ddp"])
def test_lora_on_ray_matches_the_local_executor(ray_cluster: None, local_run: Path, tmp_path: Path, strategy) -> None:
    on_ray = tmp_path / "ray"
    os.environ["RELAYRL_REFIT_IPC_DIR"] = str(tmp_path)  # ZMQ IPC sockets private to this test
    try:
        run_training(load_config(None, _overrides("ray", 2, strategy)), on_ray)
    finally:
        os.environ.pop("RELAYRL_REFIT_IPC_DIR", None)
    one, two = _per_step(local_run), _per_step(on_ray)
    assert sorted(s for s, m in one.items() if "train/loss" in m) == [1, 2, 3]
    for step, metrics in one.items():
        for key in COMPARED:
            if key in metrics:
                a, b = float(metrics[key]), float(two[step][key])
                assert math.isfinite(a) and abs(a - b) <= TOL, f"step {step} {key}: local {a} vs Ray {b}"
    assert any(float(one[s]["train/kl_penalty"]) > 0 for s in (2, 3))  # the adapters moved the policy
    assert all(float(two[s]["refit/total_count"]) >= 1 for s in (2, 3))  # generation workers were refitted
    for run in (local_run, on_ray):
        weights = run / "checkpoints" / "step_3" / "policy" / "weights"
        assert sorted(p.name for p in weights.iterdir()) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]

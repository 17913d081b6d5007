"""Both GRPO trainers end to end on the Ray executor: 3 steps with 1 and with 2 policy workers (same global batch).

Generation runs on Ray generation workers refitted from the policy after every step; the data-plane trainer keeps
rollout tensors in the Ray store and hosts its rollout actor as a Ray actor. Sampling is invariant to how rows are
split across generation workers, so 1 and 2 workers see the same rollouts and must log the same per-step
metrics (rewards, loss, KL, grad norm, validation accuracy) up to float rounding of the 2-rank gradient sum.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relayrl.algorithms.setup import run_training
from relayrl.utils.config_io import load_config

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

TOL = 1e-4
COMPARED = ("train/reward", "train/loss", "train/kl_penalty", "train/grad_norm", "validation/accuracy")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def overrides(workers: int, data_plane: bool) -> list[str]:
    """The shipped model (it solves some problems: rewards vary within a group, so gradients are not zero)."""
    return [
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=4",
        "policy.generation.max_new_tokens=12",
        "policy.optimizer.kwargs.lr=1e-3",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=3",
        "grpo.val_period=3",
        "grpo.max_val_samples=4",
        "grpo.val_batch_size=4",
        "loss_fn.reference_policy_kl_penalty=0.05",
        "checkpointing.enabled=false",
        "logger.progress_bar=false",
        "logger.tensorboard_enabled=false",
        "logger.num_train_samples_to_log=0",
        "cluster.executor=ray",
        f"cluster.workers_per_node={workers}",
        "cluster.deterministic=true",
        f"data_plane.enabled={str(data_plane).lower()}",
    ]


def run(tmp_path: Path, workers: int, data_plane: bool) -> dict[int, dict[str, Any]]:
    cfg = load_config(None, overrides(workers, data_plane))
    assert cfg.data_plane.backend == "ray"  # the default on the Ray executor
    run_dir = tmp_path / f"w{workers}"
    run_training(cfg, run_dir)
    by_step: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(int(row["step"]), {}).update(row)
    return by_step


@pytest.mark.parametrize("data_plane", [False, True], ids=["legacy", "data_plane"])
def test_grpo_on_ray_one_vs_two_workers(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_plane: bool
) -> None:
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))  # ZMQ IPC sockets private to this test
    one = run(tmp_path, 1, data_plane)
    two = run(tmp_path, 2, data_plane)
    assert sorted(s for s, m in one.items() if "train/loss" in m) == [1, 2, 3]
    assert sorted(s for s, m in one.items() if "validation/accuracy" in m) == [0, 3]
    worst = 0.0
    for step, metrics in one.items():
        for key in COMPARED:
            if key not in metrics:
                continue
            assert key in two[step], f"step {step}: {key} missing with 2 workers"
            a, b = float(metrics[key]), float(two[step][key])
            assert math.isfinite(a)
            worst = max(worst, abs(a - b))
            assert abs(a - b) <= TOL, f"step {step} {key}: 1 worker {a} vs 2 workers {b}"
    print(f"max per-step metric diff 1 vs 2 workers ({'data plane' if data_plane else 'legacy'}): {worst:.3g}")
    assert any(float(one[s]["train/grad_norm"]) > 0 for s in (1, 2, 3))  # the policy really trained
    assert any(float(one[s]["train/kl_penalty"]) > 0 for s in (2, 3))  # it moved away from the reference

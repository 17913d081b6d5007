"""`policy.generation.kv_cache_dtype=fp8` on the Ray executor with dedicated generation workers: every refit is the
collective broadcast `broadcast_weights_for_collective(kv_scales)`, carrying the scales the policy calibrated for
those weights, and at every rollout each generation worker holds exactly the latest calibration."""

from __future__ import annotations

from typing import Any

import pytest

from relayrl.algorithms.setup import run_training
from relayrl.models.generation.distributed import DistributedGeneration
from relayrl.models.policy.lm_policy import Policy
from relayrl.utils.config_io import load_config
from tests.helpers import tiny_grpo_overrides

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 6  # the shared `ray_cluster` fixture (tests/conftest.py) reads it


def test_fp8_scales_travel_with_the_collective_refit(ray_cluster: None, tmp_path, tiny_model_dir, monkeypatch) -> None:
    calibrated: list[dict[str, float]] = []
    broadcast: list[dict[str, float] | None] = []
    held: list[list[dict[str, float] | None]] = []  # every worker's scales when a rollout starts
    calibrate, send = Policy.calibrate_qkv_fp8_scales, Policy.broadcast_weights_for_collective
    prepare = DistributedGeneration.prepare_for_generation

    def calibrate_spy(policy: Policy, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = calibrate(policy, *args, **kwargs)
        calibrated.append(dict(out["layers"]))
        return out

    def send_spy(policy: Policy, kv_scales: Any = None) -> Any:
        broadcast.append(None if kv_scales is None else dict(kv_scales))
        return send(policy, kv_scales)

    def prepare_spy(engine: DistributedGeneration, *args: Any, **kwargs: Any) -> bool:
        done = prepare(engine, *args, **kwargs)
        held.append(engine.worker_kv_scales())
        return done

    monkeypatch.setattr(Policy, "calibrate_qkv_fp8_scales", calibrate_spy)
    monkeypatch.setattr(Policy, "broadcast_weights_for_collective", send_spy)
    monkeypatch.setattr(DistributedGeneration, "prepare_for_generation", prepare_spy)
    cfg = load_config(
        None,
        tiny_grpo_overrides(
            tiny_model_dir,
            "grpo.max_num_steps=2",
            "grpo.val_period=0",
            "grpo.val_at_end=false",
            "grpo.val_at_start=false",
            "checkpointing.enabled=false",
            "logger.tensorboard_enabled=false",
            "cluster.executor=ray",
            "policy.generation.kv_cache_dtype=fp8",
            "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.num_nodes=1",
            "policy.generation.colocated.resources.workers_per_node=1",
        ),
    )
    run_training(cfg, tmp_path / "run")
    # prompts of step 1 (before the first refit), then after each of the 2 steps
    assert len(calibrated) == 3
    # a refit before each rollout: the first and second carry the scales calibrated for the weights they send
    assert broadcast == calibrated[:2]
    assert held == [[calibrated[0]], [calibrated[1]]]
    assert all(v != 1.0 and v > 0 for v in calibrated[1].values())

"""Every shipped config validates; the default example is exactly the schema defaults (no drift)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config import MasterConfig, PolicyConfig, SchedulerConfig
from relayrl.utils.config_io import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_validates_and_has_launch_header(path: Path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# Launch: relayrl "), f"{path.name} must start with a '# Launch:' line"
    load_config(path)


def test_default_example_equals_schema_defaults():
    path = Path(__file__).resolve().parents[2] / "configs" / "grpo_arith_tiny.yaml"
    assert load_config(path) == MasterConfig()


def test_grpo_runs_default_to_a_cosine_lr_decay_and_keys_given_win():
    assert MasterConfig().policy.scheduler == SchedulerConfig(name="cosine", min_lr_ratio=0.1)
    warm = load_config(None, ["policy.scheduler.warmup_steps=3"]).policy.scheduler
    assert (warm.name, warm.warmup_steps, warm.min_lr_ratio) == ("cosine", 3, 0.1)
    assert load_config(None, ["policy.scheduler.name=constant"]).policy.scheduler.name == "constant"
    explicit = MasterConfig(policy=PolicyConfig(scheduler=SchedulerConfig(name="constant")))
    assert explicit.policy.scheduler.name == "constant"
    assert MasterConfig(policy=PolicyConfig(model_name="x")).policy.scheduler.name == "cosine"
    # PPO and a standalone policy (no run length to decay over) keep the constant schema default.
    assert load_config(None, ["algorithm=ppo"]).policy.scheduler.name == "constant"
    assert PolicyConfig().scheduler.name == "constant"
    resolved = MasterConfig()
    assert MasterConfig.model_validate(resolved.model_dump(mode="json")) == resolved  # run-dir config reloads as-is


def test_overrides_and_inheritance(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("grpo:\n  num_prompts_per_step: 32\n  max_num_steps: 7\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: base.yaml\ngrpo:\n  max_num_steps: 9\n")
    cfg = load_config(
        child, ["loss_fn.reference_policy_kl_penalty=0.0", "grpo.skip_reference_policy_logprobs_calculation=true"]
    )
    assert cfg.grpo.num_prompts_per_step == 32 and cfg.grpo.max_num_steps == 9
    assert cfg.loss_fn.reference_policy_kl_penalty == 0.0 and not cfg.reference_model_needed


def test_sampler_support_width_and_a_top_k_it_cannot_hold():
    from relayrl.config import GenerationConfig

    widths = [GenerationConfig(**kw).support_width for kw in ({"top_k": 3}, {"top_p": 0.9}, {"support_max_tokens": 5})]
    assert widths == [6, 64, 5]  # 2 x top_k (ties at its boundary), 64 for top_p alone, or as set
    with pytest.raises(ValueError, match="top_k=10 > policy.generation.support_max_tokens=8"):
        GenerationConfig(top_k=10, support_max_tokens=8)

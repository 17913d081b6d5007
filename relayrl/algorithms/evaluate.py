"""`relayrl evaluate`: validation metrics of a saved checkpoint, with the same validate() the trainer uses."""

from __future__ import annotations

from pathlib import Path

from relayrl.config import MasterConfig


def evaluate_checkpoint(cfg: MasterConfig, checkpoint: Path) -> dict[str, object]:
    """Load `checkpoint` (a `step_N/` directory or a Hugging Face model directory) and run validation."""
    from relayrl.algorithms.setup import load_tokenizer
    from relayrl.algorithms.validation import validate
    from relayrl.environments.registry import (
        build_environments,
        build_reward_fn_env,
        build_tool_environments,
        shutdown_all,
    )
    from relayrl.experience.data import build_dataloaders
    from relayrl.models.generation.hf_generation import HfGeneration
    from relayrl.models.policy.lm_policy import Policy
    from relayrl.models.policy.lora import is_adapter_dir

    weights = checkpoint / "policy" / "weights"
    model_dir = weights if weights.is_dir() else checkpoint
    adapters = model_dir if is_adapter_dir(model_dir) else None  # a LoRA run's: base model + these adapters
    if adapters is not None:
        if not cfg.policy.lora.enabled:
            raise ValueError(f"{adapters} holds LoRA adapters; evaluate it with policy.lora.enabled=true")
        model_dir = Path(cfg.policy.model_name)
    saved_tokenizer = checkpoint / "policy" / "tokenizer"
    tokenizer_cfg = cfg.policy.tokenizer
    if saved_tokenizer.is_dir():
        tokenizer_cfg = tokenizer_cfg.model_copy(update={"name": str(saved_tokenizer)})
    policy_cfg = cfg.policy.model_copy(update={"model_name": str(model_dir), "tokenizer": tokenizer_cfg})
    cfg = cfg.model_copy(update={"policy": policy_cfg})
    tokenizer = load_tokenizer(cfg)
    tool_envs = build_tool_environments(cfg, None, build_reward_fn_env(cfg.env))  # env.environment_factory
    _, val_dataloader = build_dataloaders(cfg, tokenizer, episode_tasks=frozenset(tool_envs))
    if val_dataloader is None:
        raise ValueError("no validation data configured (data.validation or a held-out split)")
    policy = Policy(cfg.policy, tokenizer, cluster=cfg.cluster, init_reference_model=False, init_optimizer=False)
    if adapters is not None:
        policy.load_checkpoint(str(adapters))
    generation = HfGeneration(
        cfg.policy.generation,
        tokenizer,
        policy.generation_source,
        device=policy.device,
        max_total_sequence_length=cfg.policy.max_total_sequence_length,
        seed=cfg.rollout.seed,
        precision=cfg.policy.precision,
    )
    envs = build_environments(cfg, given=tool_envs)
    try:
        generation.prepare_for_generation()
        metrics, _ = validate(generation, val_dataloader, tokenizer, envs, step=0, master_config=cfg, logger=None)
    finally:
        try:
            generation.shutdown()
            policy.shutdown()
        finally:
            shutdown_all(envs.values())
    return {**metrics, "checkpoint": str(checkpoint)}

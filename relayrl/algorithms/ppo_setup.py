"""Build a PPO run (GRPO's setup plus the critic) and run it, resuming policy *and* critic exactly.

Shares the GRPO setup's pieces (tokenizer, dataloaders, checkpoint manager, policy, colocated generation,
environments, logger); adds the `Value` model, restored with its optimizer and scheduler from `step_N/value/`.
`data_plane.enabled` selects the trainer: `ppo_train_sync` with a `TQPolicy` (which bootstraps the store) and a
`TQValue` (which attaches to it), else the legacy `ppo_train` with a `Policy` and a `Value`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.algorithms.setup import (
    GRPOComponents,
    SetupError,
    build_generation,
    check_trainer_executor,
    load_tokenizer,
    start_ray_for_run,
    summarize_run,
)
from relayrl.config import MasterConfig
from relayrl.utils.checkpoint import CheckpointManager, load_save_state
from relayrl.utils.config_io import dump_config
from relayrl.utils.logger import Logger
from relayrl.utils.seeding import enable_determinism, restore_rng_state, set_seed

__all__ = ["PPOComponents", "run_ppo", "setup_ppo"]


@dataclass
class PPOComponents(GRPOComponents):
    value: Any
    value_loss_fn: Any


def _check_value_vocabulary(cfg: MasterConfig, tokenizer: Any) -> None:
    """The critic reads the policy's token ids, so its embedding table must cover the policy tokenizer."""
    from transformers import AutoConfig

    from relayrl.utils.paths import resolve_model_path

    source = resolve_model_path(cfg.value.model_name)
    text_cfg = AutoConfig.from_pretrained(source).get_text_config()
    vocab = int(getattr(text_cfg, "vocab_size", 0) or 0)
    if vocab and vocab < len(tokenizer):
        raise ValueError(
            f"value.model_name {source} has a vocabulary of {vocab} ids but the policy tokenizer has {len(tokenizer)}; "
            "the critic must share the policy's tokenizer"
        )


def _task_names(*loaders: Any) -> list[str]:
    """Task names the datasets' rows use (a Subset is unwrapped), so every one gets an environment."""
    names: list[str] = []
    for loader in loaders:
        dataset = getattr(loader, "dataset", None)
        dataset = getattr(dataset, "dataset", dataset)
        names.extend(getattr(dataset, "task_names", []))
    return names


def setup_ppo(cfg: MasterConfig, run_dir: Path) -> PPOComponents:
    """Seed, build data, policy, critic, generation, environments, logger and checkpointer; restore on resume."""
    from relayrl.algorithms.loss_functions import ClippedPGLossFn
    from relayrl.algorithms.ppo import rollout_view
    from relayrl.algorithms.value_loss import MseValueLossFn
    from relayrl.environments.registry import build_environments
    from relayrl.environments.reward_model_registry import ensure_reward_model_env_registered
    from relayrl.experience.data import build_dataloaders
    from relayrl.models.policy.lm_policy import Policy
    from relayrl.models.value.lm_value import Value

    check_trainer_executor(cfg)
    if cfg.algorithm != "ppo":
        raise ValueError(f"setup_ppo needs algorithm: ppo, got {cfg.algorithm!r}")
    p = cfg.ppo
    view = rollout_view(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.cluster.torch_num_threads is not None:
        torch.set_num_threads(cfg.cluster.torch_num_threads)
    if cfg.cluster.deterministic:
        enable_determinism()
    set_seed(p.seed)
    ensure_reward_model_env_registered()

    tokenizer = load_tokenizer(cfg)
    _check_value_vocabulary(cfg, tokenizer)
    dataloader, val_dataloader = build_dataloaders(view, tokenizer)
    start_ray_for_run(cfg)
    checkpointer = CheckpointManager(cfg.checkpointing, cfg.checkpointing.checkpoint_dir or run_dir / "checkpoints")
    last = checkpointer.get_latest_checkpoint_path()
    save_state = load_save_state(checkpointer.load_training_info(last) if last else None)

    # Scheduler horizons count train() calls: ppo_epochs per step (the actor only after the critic warm-up).
    actor_steps = max(1, (p.max_num_steps - p.policy_training_start_step) * p.ppo_epochs)
    policy_cls: Any = Policy
    value_cls: Any = Value
    data_plane: dict[str, Any] = {}
    if cfg.data_plane.enabled:  # rollout tensors go through the sample-keyed store, not the driver
        from relayrl.models.policy.tq_policy import TQPolicy
        from relayrl.models.value.tq_value import TQValue

        policy_cls, value_cls, data_plane = TQPolicy, TQValue, {"dp_cfg": cfg.data_plane}
    policy = policy_cls(
        cfg.policy,
        tokenizer,
        cluster=cfg.cluster,
        init_reference_model=cfg.reference_model_needed,
        max_num_steps=actor_steps,
        **data_plane,
    )
    value_weights = value_optimizer = None
    if last is not None:
        optimizer_dir = last / "policy" / "optimizer"
        policy.load_checkpoint(
            weights_path=str(last / "policy" / "weights"),
            optimizer_path=str(optimizer_dir) if optimizer_dir.is_dir() else None,
        )
        dataloader.load_state_dict(torch.load(last / "train_dataloader.pt", weights_only=False))
        if not (last / "value" / "weights").is_dir():
            raise ValueError(f"checkpoint {last} has no value/weights; it was not written by a PPO run")
        value_weights = str(last / "value" / "weights")
        if (last / "value" / "optimizer").is_dir():
            value_optimizer = str(last / "value" / "optimizer")
    try:
        value = value_cls(
            cfg.value,
            tokenizer,
            cluster=cfg.cluster,
            weights_path=value_weights,
            optimizer_path=value_optimizer,
            max_num_steps=p.max_num_steps * p.ppo_epochs,
            **data_plane,
        )
    except BaseException:
        policy.shutdown()
        raise

    try:
        policy_generation = build_generation(cfg, tokenizer, policy, p.seed)
    except BaseException:
        value.shutdown()
        policy.shutdown()
        raise
    task_to_env = build_environments(cfg, _task_names(dataloader, val_dataloader))

    logger = Logger(cfg.logger, run_dir, total_steps=p.max_num_steps, start_step=save_state.total_steps)
    dump_config(cfg, run_dir / "config.yaml")
    logger.log_hyperparams(cfg.model_dump(mode="json"))

    if last is not None:
        rng = torch.load(last / "rng_state.pt", weights_only=False)
        restore_rng_state(rng["global"])
        policy_generation.set_rng_state(rng["generation"])
        logger.print_message(f"Resumed from {last} (step {save_state.total_steps})")
    return PPOComponents(
        policy=policy,
        policy_generation=policy_generation,
        dataloader=dataloader,
        val_dataloader=val_dataloader,
        tokenizer=tokenizer,
        loss_fn=ClippedPGLossFn(cfg.loss_fn),
        task_to_env=task_to_env,
        val_task_to_env=task_to_env if val_dataloader is not None else None,
        logger=logger,
        checkpointer=checkpointer,
        save_state=save_state,
        resumed_from=last,
        value=value,
        value_loss_fn=MseValueLossFn(cfg.value_loss_fn.scale, cfg.value_loss_fn.value_clip),
    )


def run_ppo(cfg: MasterConfig, run_dir: Path) -> dict[str, Any]:
    """setup_ppo() then ppo_train (or ppo_train_sync with the data plane); returns the run summary."""
    from relayrl.algorithms.ppo import ppo_train
    from relayrl.algorithms.ppo_sync import ppo_train_sync

    trainer = ppo_train_sync if cfg.data_plane.enabled else ppo_train

    try:
        c = setup_ppo(cfg, run_dir)
    except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, OSError) as exc:
        raise SetupError(str(exc).strip("'\"")) from exc
    try:
        trainer(
            c.policy,
            c.policy_generation,
            c.value,
            c.dataloader,
            c.val_dataloader,
            c.tokenizer,
            c.loss_fn,
            c.value_loss_fn,
            c.task_to_env,
            c.val_task_to_env,
            c.logger,
            c.checkpointer,
            c.save_state,
            cfg,
        )
    finally:
        c.logger.close()
        c.policy_generation.shutdown()
        c.value.shutdown()  # the critic's client is attached to the store the policy owns: close it first
        c.policy.shutdown()
        for env in c.task_to_env.values():
            env.shutdown()
    return summarize_run(run_dir)

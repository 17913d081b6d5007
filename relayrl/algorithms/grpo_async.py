"""GRPO, asynchronous: a producer generates the next batches while the current step trains, under a staleness bound.

Why: with a core (or device) for each side, a step costs about the larger of generation and training instead of
their sum. The trainer is `grpo_sync.GRPOSyncSteps` itself, given a `producer_source.ProducerSource` instead of the
rollout actor's source: a step claims the batch the producer made for it (`async_rollouts.RolloutProducer`). What
async adds goes through the source's hooks: a weights snapshot published after the optimizer step; batch k made by
weights version `k - 1 - d` (d = `grpo.async_grpo.max_trajectory_age_steps`), so timing never decides which
weights made which samples (d = 0 reproduces `grpo_train_sync`); the importance-sampling correction for stale
samples; each batch's partition retired after its step; checkpoints that drain and store the producer
(`async_state.py`; the batches' rows in the checkpoint's data-plane store with `checkpointing.save_data_plane`), so
a resume logs what the uninterrupted run logs.

This module builds what the producer generates with (`ProducerSide`, per executor: locally with a copy of the
environments of its own, since validation rolls out on the trainer's thread at the same time; on Ray its own rollout
actor, which builds its own instances. Environment classes' episodes then live in the producer, and the batches in
flight at a checkpoint come back from it with their rows and counts), restores a checkpoint's batches and starts the run. How to use it: the README's "Asynchronous GRPO"; where
the producer generates and how it shares workers with validation: docs/design.md.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, cast

import torch

from relayrl.algorithms.async_rollouts import LookaheadLoader, ProducerEngine
from relayrl.algorithms.async_state import ASYNC_STATE, load_producer_state, restore_batches
from relayrl.algorithms.grpo_sync import GRPOSyncSteps, grpo_rollout_spec
from relayrl.algorithms.interfaces import LossFunction
from relayrl.algorithms.producer_source import ASYNC_FLIGHT_ROWS, PinnedSource, ProducerSide, ProducerSource
from relayrl.algorithms.protocols import BatchLoader, DataPlanePolicy, Generation, RolloutActor, Tokenizer
from relayrl.algorithms.runner import LoopParts, run_loop
from relayrl.algorithms.trainer_common import KvScaleSync
from relayrl.algorithms.validation import Envs, sync_validator
from relayrl.config import GenerationConfig, MasterConfig
from relayrl.distributed import refit_manifest
from relayrl.environments.registry import fork_environments
from relayrl.experience.flight_recorder import import_rows
from relayrl.experience.ray_rollout import RayRolloutActor, rollout_actor_cls
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState
from relayrl.utils.logger import Logger
from relayrl.utils.timer import Timer

__all__ = ["ASYNC_FLIGHT_ROWS", "grpo_train_async"]


class _RayWeights(Protocol):
    """The Ray executor's policy: rank 0's weights arrive in the driver as a host copy (no device tensor reaches a
    driver that may have no GPU)."""

    def host_state_dict(self) -> dict[str, torch.Tensor]: ...


class _LocalModel(Protocol):
    """The local executor's policy: its rank-0 worker, or under LoRA its merged view (a plain module, re-merged per
    version), as the module the producer's private engine copies."""

    @property
    def generation_source(self) -> Any: ...


def _producer_side(
    cfg: MasterConfig,
    policy: DataPlanePolicy,
    policy_generation: Generation,
    tokenizer: Tokenizer,
    task_to_env: Envs,
    start_version: int,
) -> ProducerSide:
    actor_cls = rollout_actor_cls(cfg)
    if cfg.cluster.executor == "ray":
        from relayrl.data_plane.factory import build_data_plane_client
        from relayrl.models.generation.distributed import DistributedGeneration

        assert isinstance(policy_generation, DistributedGeneration)  # the Ray executor's engine
        twin = policy_generation.snapshot_copy(cfg.grpo.seed)
        client = build_data_plane_client(cfg.data_plane, bootstrap=False, in_driver=True)
        try:
            actor = RayRolloutActor(twin, tokenizer, task_to_env, cfg, cfg.data_plane)
        except BaseException:
            client.close()
            raise
        weights = cast(_RayWeights, policy).host_state_dict
        return ProducerSide(twin, actor, client, weights, ray_actor=actor, own_client=True)
    source = cast(_LocalModel, policy).generation_source
    pin = PinnedSource(source.model, start_version)
    device = next(pin.model.parameters()).device
    gen_cfg = cfg.policy.generation.model_copy(
        update={"colocated": cfg.policy.generation.colocated.model_copy(update={"enabled": False})}
    )
    engine = _local_engine(cfg, gen_cfg, tokenizer, pin, device)

    def clone_live() -> dict[str, torch.Tensor]:
        weights = refit_manifest.snapshot(source.model.state_dict().items())  # a tied tensor copied once
        if device.type == "cuda":  # the producer reads the copy on its own stream: finish it first
            torch.cuda.current_stream(device).synchronize()
        return weights

    # environments of their own: validation rolls out on the trainer's thread while the producer rolls out on its own
    envs = fork_environments(task_to_env)
    own = [env for env in envs.values() if all(env is not shared for shared in task_to_env.values())]
    try:
        local = actor_cls(engine, tokenizer, envs, cfg, cfg.data_plane)
    except BaseException:
        engine.shutdown()
        raise
    return ProducerSide(engine, local, local.client, clone_live, pin=pin, envs=own)


def _local_engine(
    cfg: MasterConfig, gen_cfg: GenerationConfig, tokenizer: Tokenizer, pin: PinnedSource, device: Any
) -> ProducerEngine:
    """The local producer's private engine: in a child process (`grpo.async_grpo.generator=process`, CPU), so
    decoding does not share the trainer's interpreter lock; else an `HfGeneration` driven from the producer thread."""
    a = cfg.grpo.async_grpo
    if a.generator == "process" and torch.device(device).type == "cpu":
        from relayrl.models.generation.process_generation import ProcessGeneration

        c = cfg.cluster
        return ProcessGeneration(
            gen_cfg,
            tokenizer,
            pin.model,
            pin.weights_version,
            max_total_sequence_length=cfg.policy.max_total_sequence_length,
            seed=cfg.grpo.seed,
            num_threads=a.generation_threads or c.torch_num_threads,
            deterministic=c.deterministic,
            retain_freed_memory=c.retain_freed_memory,
            precision=cfg.policy.precision,
        )
    from relayrl.models.generation.hf_generation import HfGeneration

    return HfGeneration(
        gen_cfg,
        tokenizer,
        pin,
        device=device,
        max_total_sequence_length=cfg.policy.max_total_sequence_length,
        seed=cfg.grpo.seed,
        precision=cfg.policy.precision,
    )


def grpo_train_async(
    policy: DataPlanePolicy,
    policy_generation: Generation,
    wrapped_dataloader: BatchLoader,
    val_dataloader: BatchLoader | None,
    tokenizer: Tokenizer,
    loss_fn: LossFunction,
    task_to_env: Envs,
    val_task_to_env: Envs | None,
    logger: Logger,
    checkpointer: CheckpointManager,
    grpo_save_state: GRPOSaveState,
    master_config: MasterConfig,
) -> dict[str, object]:
    """Run asynchronous GRPO through the data plane. Same signature, stopping rules and metrics as the sync
    trainer, plus the `async/*` staleness metrics."""
    cfg = master_config
    if not (cfg.data_plane.enabled and cfg.grpo.async_grpo.enabled):
        raise ValueError("grpo_train_async needs data_plane.enabled=true and grpo.async_grpo.enabled=true")

    timer = Timer()
    val_actor: RolloutActor = rollout_actor_cls(cfg)(policy_generation, tokenizer, task_to_env, cfg, cfg.data_plane)
    start_version = grpo_save_state.total_steps
    try:
        side = _producer_side(cfg, policy, policy_generation, tokenizer, task_to_env, start_version)
    except BaseException:
        val_actor.shutdown()
        raise
    steps: GRPOSyncSteps | None = None  # once built, closing it closes the source: the producer, its side, the actor
    try:
        last = checkpointer.get_latest_checkpoint_path() if start_version > 0 else None
        saved = last / ASYNC_STATE if last is not None else None
        restored = load_producer_state(saved, grpo_save_state, cfg)
        state, rng, dropped = restored.state, restored.rng, restored.dropped_groups
        if rng is not None:
            side.engine.set_rng_state(rng)
        restore_batches(restored, side.client, cfg.grpo.num_generations_per_prompt)
        rows_file = last / ASYNC_FLIGHT_ROWS if last is not None else None
        if rows_file is not None and rows_file.is_file():  # the recorder's rows of those batches
            rows = json.loads(rows_file.read_text())
            stash = getattr(side.actor, "flight", None)
            if side.ray_actor is not None:
                for b in state.ready:
                    b.flight_rows = {b.meta.partition_id: rows.get(b.meta.partition_id, {})}
            elif stash is not None:
                import_rows(stash, rows)
        kv_sync = KvScaleSync(policy, policy_generation, timer, tokenizer.pad_token_id, val_dataloader)  # fp8: refused
        validate_at = sync_validator(val_actor, policy, val_dataloader, val_task_to_env, cfg, logger)
        source = ProducerSource(
            policy=policy, actor=val_actor, side=side, loader=wrapped_dataloader, state=state, dropped_groups=dropped,
            carry_keys=grpo_rollout_spec(cfg, policy).carry_keys, cfg=cfg, timer=timer, logger=logger,
        )  # fmt: skip
        steps = GRPOSyncSteps(policy, policy_generation, source, loss_fn, logger, cfg, timer, validate_at, kv_sync)
        loader = LookaheadLoader(source.producer, wrapped_dataloader)
        parts = LoopParts(cfg, grpo_save_state, timer, loader, policy, policy_generation, checkpointer, logger,
                          save_extra=source.save_state)  # fmt: skip
        source.producer.start()
    except BaseException:
        if steps is None:
            try:
                side.shutdown()
            finally:
                val_actor.shutdown()
        else:
            steps.close()
        raise
    return run_loop(steps, parts)

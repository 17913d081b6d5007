"""The kinds of run components a set-up builds: `LegacyComponents` (driver-side tensors) and `DataPlaneComponents`
(rollout tensors in the sample-keyed store), each typed with its trainers' Protocols.

A kind's `build_*` return the concrete model classes as those Protocols, so a class that stops fitting the trainers
that take it fails mypy here rather than at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from relayrl.algorithms.interfaces import LossFunction
from relayrl.algorithms.protocols import (
    BatchLoader,
    BuiltDataPlanePolicy,
    BuiltPolicy,
    DataPlanePolicy,
    DataPlaneValue,
    Generation,
    Policy,
    Tokenizer,
    Value,
)
from relayrl.config import MasterConfig
from relayrl.environments.interfaces import EnvironmentInterface
from relayrl.environments.registry import shutdown_all
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState
from relayrl.utils.dir_lock import DirLock
from relayrl.utils.logger import Logger

__all__ = ["ComponentsT", "DataPlaneComponents", "LegacyComponents", "RunComponents"]


PolicyT = TypeVar("PolicyT", bound=Policy | DataPlanePolicy)
ValueT = TypeVar("ValueT", bound=Value | DataPlaneValue)


@dataclass
class RunComponents(Generic[PolicyT, ValueT]):
    """Everything a trainer takes, built once: `LegacyComponents` or `DataPlaneComponents`, for the kind of trainer
    the config selects. `value` and `value_loss_fn` exist for PPO only. Each kind's `build_*` return the concrete
    classes as its Protocols, so a class that stops fitting its trainers fails mypy there."""

    policy: PolicyT
    policy_generation: Generation  # HfGeneration, or DistributedGeneration on Ray
    dataloader: BatchLoader
    val_dataloader: BatchLoader | None
    tokenizer: Tokenizer
    loss_fn: LossFunction
    task_to_env: dict[str, EnvironmentInterface]
    val_task_to_env: dict[str, EnvironmentInterface] | None
    logger: Logger
    checkpointer: CheckpointManager
    save_state: GRPOSaveState
    resumed_from: Path | None
    value: ValueT | None = None
    value_loss_fn: LossFunction | None = None
    run_locks: list[DirLock] | None = None  # this run owns its run (and checkpoint) directory while these live

    def close(self) -> None:
        """Release everything `setup` built, in the order the store needs (every user of it: run, replay, bench)."""
        try:
            self.logger.close()
            self.policy_generation.shutdown()
            if self.value is not None:
                self.value.shutdown()  # the critic's client is attached to the store the policy owns: close it first
            self.policy.shutdown()
        finally:  # whatever failed above, the environments' open episodes (served sessions) are closed
            try:
                shutdown_all([*self.task_to_env.values(), *(self.val_task_to_env or {}).values()])
            finally:
                for lock in self.run_locks or ():
                    lock.release()


class LegacyComponents(RunComponents[Policy, Value]):
    """For the legacy trainers (`grpo.grpo_train`, `ppo.ppo_train`): every pass takes and returns driver tensors."""

    @staticmethod
    def build_policy(cfg: MasterConfig, tokenizer: Tokenizer) -> BuiltPolicy:
        from relayrl.models.policy.lm_policy import Policy as LMPolicy

        return LMPolicy(cfg.policy, tokenizer, **policy_options(cfg))

    @staticmethod
    def build_value(cfg: MasterConfig, tokenizer: Tokenizer, last: Path | None) -> Value:
        from relayrl.models.value.lm_value import Value as LMValue

        return LMValue(cfg.value, tokenizer, **value_options(cfg, last))


class DataPlaneComponents(RunComponents[DataPlanePolicy, DataPlaneValue]):
    """For the data-plane trainers (`grpo_sync`, `grpo_async`, `ppo_sync`, replay): rollout tensors go through the
    sample-keyed store, not the driver; the policy bootstraps the store and the critic attaches to it."""

    @staticmethod
    def build_policy(cfg: MasterConfig, tokenizer: Tokenizer) -> BuiltDataPlanePolicy:
        from relayrl.models.policy.tq_policy import TQPolicy

        return TQPolicy(cfg.policy, tokenizer, dp_cfg=cfg.data_plane, **policy_options(cfg))

    @staticmethod
    def build_value(cfg: MasterConfig, tokenizer: Tokenizer, last: Path | None) -> DataPlaneValue:
        from relayrl.models.value.tq_value import TQValue

        return TQValue(cfg.value, tokenizer, dp_cfg=cfg.data_plane, **value_options(cfg, last))


#: The kind of components a set-up builds; `_setup` is checked by mypy once for each.
ComponentsT = TypeVar("ComponentsT", LegacyComponents, DataPlaneComponents)


def policy_options(cfg: MasterConfig) -> dict[str, Any]:
    """The policy's keyword arguments beside its config. Its scheduler's horizon counts `train()` calls: one per
    GRPO step; PPO's `ppo_epochs` per step once the critic warm-up is over."""
    horizon = cfg.rollout.max_num_steps
    if cfg.algorithm == "ppo":
        p = cfg.ppo
        horizon = max(1, (p.max_num_steps - p.policy_training_start_step) * p.ppo_epochs)
    return dict(cluster=cfg.cluster, init_reference_model=cfg.reference_model_needed, max_num_steps=horizon)


def value_options(cfg: MasterConfig, last: Path | None) -> dict[str, Any]:
    """PPO's critic's keyword arguments beside its config: restored with its optimizer and scheduler from
    `step_N/value/` on resume."""
    weights = optimizer = None
    if last is not None:
        if not (last / "value" / "weights").is_dir():
            raise ValueError(f"checkpoint {last} has no value/weights; it was not written by a PPO run")
        weights = str(last / "value" / "weights")
        if (last / "value" / "optimizer").is_dir():
            optimizer = str(last / "value" / "optimizer")
    p = cfg.ppo
    return dict(
        cluster=cfg.cluster,
        weights_path=weights,
        optimizer_path=optimizer,
        max_num_steps=p.max_num_steps * p.ppo_epochs,
    )

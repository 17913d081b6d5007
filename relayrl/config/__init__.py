"""The run configuration: pydantic models whose defaults *are* the embedded default run.

Key names follow the reference system (`policy.model_name`, `grpo.num_prompts_per_step`, `loss_fn.*`,
`checkpointing.save_period`, `data_plane.*`) so its users feel at home. Unknown keys and bad values are rejected
with the dotted key named. This package imports neither torch nor ray, so validation and `--help` stay fast.

The schema lives in four modules (`base`, `policy`, `rollout`, `infra`); this one holds `MasterConfig`, the
cross-field checks, and re-exports every block so `from relayrl.config import X` names any of them. Before
validation `nemo_layout` reads NeMo RL's key layout into relayrl's, resolving `${...}` with `interpolation`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from relayrl.config.base import BUILTIN_TINY_MODEL, VALIDATION_METRICS, NonNegFloat, NonNegInt, Strict, UnitFloat
from relayrl.config.infra import ENVIRONMENT_TASK as ENVIRONMENT_TASK
from relayrl.config.infra import REWARD_FNS_TASK as REWARD_FNS_TASK
from relayrl.config.infra import (
    ArithmeticConfig,
    CheckpointingConfig,
    ClusterConfig,
    DataConfig,
    DataPlaneConfig,
    DatasetConfig,
    EnvConfig,
    FlightRecorderConfig,
    LoggerConfig,
    MathEnvConfig,
    MlflowConfig,
    RewardModelEnvConfig,
    WandbConfig,
)
from relayrl.config.policy import (
    AdamWKwargs,
    ClippedPGLossConfig,
    ColocatedConfig,
    DataParallelConfig,
    DynamicBatchingConfig,
    GenerationConfig,
    GenerationResourcesConfig,
    LoraConfig,
    MseValueLossConfig,
    OptimizerConfig,
    PolicyConfig,
    SchedulerConfig,
    SequencePackingConfig,
    TokenizerConfig,
    ValueConfig,
)
from relayrl.config.rollout import (
    AdvEstimatorConfig,
    GRPOConfig,
    PPOAdvEstimatorConfig,
    PPOConfig,
    RewardPenaltiesConfig,
    RewardScalingConfig,
    RewardShapingConfig,
    RolloutConfig,
)

__all__ = [
    "BUILTIN_TINY_MODEL",
    "GRPO_LR_SCHEDULE",
    "ENVIRONMENT_TASK",
    "REWARD_FNS_TASK",
    "VALIDATION_METRICS",
    "AdamWKwargs",
    "AdvEstimatorConfig",
    "ArithmeticConfig",
    "CheckpointingConfig",
    "ClippedPGLossConfig",
    "ClusterConfig",
    "ColocatedConfig",
    "DataConfig",
    "DataParallelConfig",
    "DataPlaneConfig",
    "DatasetConfig",
    "DynamicBatchingConfig",
    "EnvConfig",
    "GRPOConfig",
    "GenerationConfig",
    "GenerationResourcesConfig",
    "FlightRecorderConfig",
    "LoggerConfig",
    "LoraConfig",
    "MasterConfig",
    "MathEnvConfig",
    "MlflowConfig",
    "MseValueLossConfig",
    "NonNegFloat",
    "NonNegInt",
    "OptimizerConfig",
    "PPOAdvEstimatorConfig",
    "PPOConfig",
    "PolicyConfig",
    "RewardModelEnvConfig",
    "RewardPenaltiesConfig",
    "RewardScalingConfig",
    "RewardShapingConfig",
    "RolloutConfig",
    "SchedulerConfig",
    "SequencePackingConfig",
    "Strict",
    "TokenizerConfig",
    "UnitFloat",
    "ValueConfig",
    "WandbConfig",
]


# ---------------------------------------------------------------------------------------------------- top level
#: `policy.scheduler` of a GRPO run that sets none (see MasterConfig._grpo_lr_schedule).
GRPO_LR_SCHEDULE: dict[str, Any] = {"name": "cosine", "min_lr_ratio": 0.1}


class MasterConfig(Strict):
    algorithm: Literal["grpo", "ppo"] = "grpo"
    """Which trainer `relayrl train` runs: GRPO (the `grpo` block) or actor-critic PPO (`ppo`, `value`)."""
    policy: PolicyConfig = PolicyConfig()
    """The trained model: weights, tokenizer, batch sizes, optimizer, schedule, generation and micro-batching."""
    loss_fn: ClippedPGLossConfig = ClippedPGLossConfig()
    """The policy loss (both algorithms): ratio clipping, importance sampling, reference KL."""
    grpo: GRPOConfig = GRPOConfig()
    """Rollout, validation and advantage settings of a GRPO run (ignored when algorithm is ppo)."""
    data: DataConfig = DataConfig()
    """Training and validation prompts and how they become chat prompts."""
    env: EnvConfig = EnvConfig()
    """The environments that score rollouts, chosen per row by its task name."""
    logger: LoggerConfig = LoggerConfig()
    """Metric sinks, console output and logged samples."""
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    """When and where checkpoints are saved, which are kept, and the wall-clock budget."""
    cluster: ClusterConfig = ClusterConfig()
    """Executor, worker count and placement, device and per-worker runtime settings."""
    reward_penalties: RewardPenaltiesConfig = RewardPenaltiesConfig()
    """Message-level advantage overrides for flagged assistant messages: applied by the synchronous GRPO trainers
    (legacy and data-plane), refused by asynchronous GRPO and `relayrl replay`, refused with PPO."""
    data_plane: DataPlaneConfig = DataPlaneConfig()
    """The sample-keyed store rollout tensors move through (off: the legacy in-memory trainers)."""
    ppo: PPOConfig = PPOConfig()
    """Rollout, validation, update schedule and GAE settings of a PPO run (ignored when algorithm is grpo)."""
    value: ValueConfig = ValueConfig()
    """PPO's critic model (unused by GRPO)."""
    value_loss_fn: MseValueLossConfig = MseValueLossConfig()
    """PPO's critic loss (unused by GRPO)."""

    @model_validator(mode="before")
    @classmethod
    def _grpo_lr_schedule(cls, data: Any) -> Any:
        """In a GRPO run `policy.scheduler` defaults to cosine decay to 10% over grpo.max_num_steps (keys given win).

        Why: at a constant LR the default run's validation accuracy keeps swinging by +-3 points once it has learned
        (the last value read anywhere in 0.55-0.615 on one seed); with the decay it settles (0.61-0.625 over the
        last 350 steps). PPO and a standalone PolicyConfig (no run length to decay over) keep the constant default.
        """
        if not isinstance(data, dict) or data.get("algorithm", "grpo") != "grpo":
            return data
        policy = data.get("policy")
        if isinstance(policy, PolicyConfig):
            kept: dict[str, Any] = {}
            if "scheduler" in policy.model_fields_set:
                kept = policy.scheduler.model_dump(include=policy.scheduler.model_fields_set)
            merged = SchedulerConfig(**{**GRPO_LR_SCHEDULE, **kept})
            return {**data, "policy": policy.model_copy(update={"scheduler": merged})}
        if policy is None or isinstance(policy, dict):
            given = (policy or {}).get("scheduler")
            if given is None or isinstance(given, dict):
                raw_scheduler = {**GRPO_LR_SCHEDULE, **(given or {})}
                return {**data, "policy": {**(policy or {}), "scheduler": raw_scheduler}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _executor_defaults(cls, data: Any) -> Any:
        """data_plane.backend, when not given, is `memory` on the local executor and `ray` on the Ray executor."""
        if not isinstance(data, dict):
            return data
        cluster, plane = data.get("cluster"), data.get("data_plane")
        executor = cluster.get("executor") if isinstance(cluster, dict) else getattr(cluster, "executor", None)
        if executor == "ray" and (plane is None or (isinstance(plane, dict) and "backend" not in plane)):
            return {**data, "data_plane": {**(plane or {}), "backend": "ray"}}
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> MasterConfig:
        p = self.policy
        r = self.rollout
        block = self.algorithm
        rows = r.rows_per_step
        batch_owners = [("policy", p.train_global_batch_size, p.train_micro_batch_size)]
        if self.algorithm == "ppo":
            batch_owners.append(("value", self.value.train_global_batch_size, self.value.train_micro_batch_size))
        for owner, gbs, mbs in batch_owners:
            if rows % gbs:
                raise ValueError(
                    f"{block}.num_prompts_per_step x {block}.num_generations_per_prompt = {rows} is not divisible by "
                    f"{owner}.train_global_batch_size = {gbs}"
                )
            if gbs % mbs:
                raise ValueError(
                    f"{owner}.train_global_batch_size = {gbs} is not divisible by {owner}.train_micro_batch_size = {mbs}"
                )
            ranks = self.cluster.num_nodes * self.cluster.workers_per_node
            if gbs % (ranks * mbs):
                raise ValueError(
                    f"{owner}.train_global_batch_size = {gbs} must split into {ranks} data-parallel workers of whole "
                    f"micro-batches of {owner}.train_micro_batch_size = {mbs}: make it a multiple of {ranks * mbs}"
                )
        g = self.grpo
        problem = _async_grpo_problem(self)
        if problem is not None:
            raise ValueError(problem)
        if self.algorithm == "grpo" and g.num_generations_per_prompt < 2:
            raise ValueError(
                "grpo.num_generations_per_prompt must be >= 2: GRPO's advantage is a reward relative to the other "
                "generations of the same prompt, so with one generation every advantage is 0 (use algorithm: ppo)"
            )
        if self.algorithm == "ppo" and self.reward_penalties.enabled_keys():
            key = self.reward_penalties.enabled_keys()[0]
            raise ValueError(
                f"reward_penalties.{key} applies to GRPO only (PPO's per-token advantages come from GAE): remove it"
            )
        if self.algorithm == "ppo" and self.value.tokenizer != TokenizerConfig():
            raise ValueError(
                "value.tokenizer is not used: the critic scores the policy's token ids with policy.tokenizer; remove it"
            )
        kl_in_reward = self.loss_fn.use_kl_in_reward and self.loss_fn.reference_policy_kl_penalty > 0
        if self.loss_fn.use_kl_in_reward and self.loss_fn.force_on_policy_ratio:
            raise ValueError(
                "loss_fn.force_on_policy_ratio=true skips the previous-log-prob pass that loss_fn.use_kl_in_reward=true "
                "needs for the KL in the reward: set one of them to false"
            )
        if self.algorithm == "grpo" and kl_in_reward and g.adv_estimator.name == "grpo":
            raise ValueError(
                "loss_fn.use_kl_in_reward=true with grpo.adv_estimator.name='grpo' would drop the KL penalty (the loss "
                "then uses no KL and the grpo estimator adds none to the reward): use "
                "grpo.adv_estimator.name=reinforce_plus_plus, or loss_fn.use_kl_in_reward=false"
            )
        lo, hi = g.advantage_clip_low, g.advantage_clip_high
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"grpo.advantage_clip_low ({lo}) must be <= grpo.advantage_clip_high ({hi})")
        for name, blk in (("grpo", g), ("ppo", self.ppo)):
            if blk.batch_multiplier != 1 and not blk.use_dynamic_sampling:
                raise ValueError(f"{name}.batch_multiplier must be 1 unless {name}.use_dynamic_sampling is true")
        if r.use_dynamic_sampling and r.num_generations_per_prompt < 2:
            raise ValueError(
                f"{block}.use_dynamic_sampling=true needs {block}.num_generations_per_prompt >= 2: a group of one row "
                "has no reward spread, so every row would be dropped"
            )
        for key in ("invalid_tool_call_advantage", "malformed_thinking_advantage"):
            if getattr(g, key) is not None and getattr(self.reward_penalties, key) is not None:
                raise ValueError(f"grpo.{key} and reward_penalties.{key} are the same setting: set one of them")
        if r.stop_at_validation_metric is not None and r.stop_at_validation_threshold is None:
            raise ValueError(f"{block}.stop_at_validation_metric requires {block}.stop_at_validation_threshold")
        if r.stop_at_validation_metric is not None and r.stop_at_validation_metric not in VALIDATION_METRICS:
            raise ValueError(
                f"{block}.stop_at_validation_metric {r.stop_at_validation_metric!r} is not a validation metric; "
                f"use one of {', '.join(VALIDATION_METRICS)}"
            )
        if r.val_pass_k is not None and r.val_pass_k > r.val_num_generations_per_prompt:
            raise ValueError(
                f"{block}.val_pass_k = {r.val_pass_k} exceeds {block}.val_num_generations_per_prompt = "
                f"{r.val_num_generations_per_prompt} (pass@k needs at least k rollouts per prompt)"
            )
        if r.stop_at_validation_metric == "pass_k" and r.val_num_generations_per_prompt <= 1:
            raise ValueError(f"{block}.stop_at_validation_metric 'pass_k' requires val_num_generations_per_prompt > 1")
        copies = self.data.validation.repeat if self.data.validation is not None else 1
        if copies > 1 and r.val_greedy:
            raise ValueError(
                f"data.validation.repeat={copies} with {block}.val_greedy=true: greedy decoding answers every copy "
                f"alike; set {block}.val_greedy=false (each copy sampled, as NeMo RL validates) or repeat 1"
            )
        if r.max_val_samples % r.val_batch_size and r.max_val_samples > r.val_batch_size:
            raise ValueError(f"{block}.max_val_samples must be a multiple of {block}.val_batch_size")
        if r.skip_reference_policy_logprobs_calculation and self.loss_fn.reference_policy_kl_penalty != 0:
            raise ValueError(
                f"{block}.skip_reference_policy_logprobs_calculation requires loss_fn.reference_policy_kl_penalty == 0"
            )
        ranks = self.cluster.num_nodes * self.cluster.workers_per_node
        dp_owners = [("policy", p.data_parallel)] + ([("value", self.value.data_parallel)] if block == "ppo" else [])
        for owner, dp in dp_owners:
            if dp.strategy != "manual" and ranks > 1 and self.cluster.executor == "local":
                raise ValueError(
                    f"{owner}.data_parallel.strategy={dp.strategy!r} needs cluster.executor='ray' with {ranks} workers "
                    "(in-process workers support only 'manual')"
                )
        if self.cluster.executor == "ray":
            res = p.generation.colocated.resources
            if not p.generation.colocated.enabled and (res.num_nodes is None or res.workers_per_node is None):
                raise ValueError(
                    "policy.generation.colocated.enabled=false on cluster.executor=ray needs "
                    "policy.generation.colocated.resources.num_nodes and .workers_per_node (dedicated generation workers)"
                )
            if self.data_plane.enabled and self.data_plane.backend == "memory":
                raise ValueError(
                    "data_plane.backend=memory is in-process and cannot be shared by Ray workers; use ray (the default "
                    "on cluster.executor=ray) or transfer_queue"
                )
        if self.checkpointing.save_data_plane and not self.data_plane.enabled:
            raise ValueError("checkpointing.save_data_plane=true needs data_plane.enabled=true (there is no store)")
        if self.data_plane.enabled:
            val_rows = min(r.max_val_samples, r.val_batch_size) * r.val_num_generations_per_prompt
            need = max(r.rows_per_step * r.batch_multiplier, val_rows)
            if self.data_plane.storage_capacity < need:
                raise ValueError(
                    f"data_plane.storage_capacity = {self.data_plane.storage_capacity} is below the {need} samples a "
                    f"step or validation batch writes; raise it to at least {need}"
                )
        if p.generation.max_new_tokens >= p.max_total_sequence_length:
            raise ValueError("policy.generation.max_new_tokens must be < policy.max_total_sequence_length")
        for key, ds in (("data.train", self.data.train), ("data.validation", self.data.validation)):
            if ds is not None and ds.source in ("file", "hf") and not ds.path:
                raise ValueError(f"{key}.path is required when {key}.source is '{ds.source}'")
        if self.env.environment_factory is not None or self.env.openenv is not None:
            apply_environment_defaults(self, several=isinstance(self.env.environment_factory, dict))
        elif self.env.reward_fns:  # the reward functions score every row that names no task of its own
            for ds in (self.data.train, self.data.validation):
                if ds is not None and "default_task" not in ds.model_fields_set:
                    ds.default_task = REWARD_FNS_TASK
        return self

    # Derived values live here (not as duplicated defaults) so every consumer agrees.
    @property
    def logprob_batch_size(self) -> int:
        return self.policy.logprob_batch_size or self.policy.train_micro_batch_size

    @property
    def max_prompt_length(self) -> int:
        if self.data.max_input_seq_length is not None:
            return self.data.max_input_seq_length
        return self.policy.max_total_sequence_length - self.policy.generation.max_new_tokens

    @property
    def rollout(self) -> RolloutConfig:
        """The block holding the rollout/validation settings of the selected algorithm."""
        return self.grpo if self.algorithm == "grpo" else self.ppo

    @property
    def reference_model_needed(self) -> bool:
        skip = self.rollout.skip_reference_policy_logprobs_calculation
        return self.loss_fn.reference_policy_kl_penalty > 0 and not skip


def apply_environment_defaults(cfg: MasterConfig, several: bool) -> None:
    """Environment classes (`env.environment_factory`, or `relayrl.train(environment_factory=...)`): their rows are
    the datasets' default task (one class) or are routed by their `environment` column (several). Every trainer
    runs them (asynchronous GRPO on Ray: in the producer's rollout actor, which builds instances of its own)."""
    for ds in (cfg.data.train, cfg.data.validation):
        if ds is None:
            continue
        if several and "task_field" not in ds.model_fields_set:
            ds.task_field = ENVIRONMENT_TASK
        if not several and "default_task" not in ds.model_fields_set:
            ds.default_task = ENVIRONMENT_TASK


def _async_grpo_problem(cfg: MasterConfig) -> str | None:
    """The one-line reason `grpo.async_grpo.enabled=true` cannot run with this config, or None."""
    a, g = cfg.grpo.async_grpo, cfg.grpo
    if not a.enabled:
        return None
    fix = "set grpo.async_grpo.enabled=false or change"
    if cfg.algorithm != "grpo":
        return f"grpo.async_grpo.enabled=true needs algorithm=grpo (got {cfg.algorithm!r}); {fix} the algorithm"
    if not cfg.data_plane.enabled:
        return (
            f"grpo.async_grpo.enabled=true needs data_plane.enabled=true (rollouts travel through the store); {fix} it"
        )
    if cfg.cluster.executor == "ray" and cfg.policy.generation.colocated.enabled:
        return (
            "grpo.async_grpo.enabled=true on cluster.executor=ray generates on dedicated workers: set "
            "policy.generation.colocated.enabled=false and policy.generation.colocated.resources.{num_nodes,workers_per_node}"
        )
    if cfg.cluster.executor == "ray" and cfg.data_plane.backend != "ray":
        return (
            "grpo.async_grpo.enabled=true on cluster.executor=ray needs data_plane.backend=ray for now "
            f"(got {cfg.data_plane.backend!r}; every backend runs on the local executor)"
        )
    if g.use_dynamic_sampling:
        return "grpo.async_grpo.enabled=true with grpo.use_dynamic_sampling: a step's batch would depend on later ones"
    if (
        a.max_trajectory_age_steps > 0
        and cfg.loss_fn.force_on_policy_ratio
        and g.rows_per_step != cfg.policy.train_global_batch_size
    ):
        return (
            "loss_fn.force_on_policy_ratio=true with grpo.async_grpo.max_trajectory_age_steps > 0 and several "
            "optimizer steps per batch: later steps need the ratio; set it false"
        )
    if a.generation_threads is not None and a.generator != "process":
        return (
            "grpo.async_grpo.generation_threads needs grpo.async_grpo.generator=process (a thread shares the trainer's)"
        )
    if a.in_flight_weight_updates:
        return "grpo.async_grpo.in_flight_weight_updates=true: the local generator refits between batches; set it false"
    if cfg.policy.generation.kv_cache_dtype == "fp8":
        return "policy.generation.kv_cache_dtype=fp8 with grpo.async_grpo: the producer's engine gets no KV scales yet"
    return None

"""PPO, data-plane path: rollout tensors live in a sample-keyed store; the driver handles metadata and per-row scalars.

Sibling of `ppo.py`, phase for phase (same timers, same order, same helpers and metrics), so the two read side by
side and log identical numbers (`relayrl parity`). Only data movement differs:
- the rollout actor writes the bulk (`input_ids`, `generation_logprobs`, `token_mask`, `sample_mask`) once, under
  keys minted at rollout, and returns a small per-row carry (rewards, lengths, loss-token counts);
- the critic's workers write `values`, the policy's workers `prev_logprobs` / `reference_policy_logprobs`, all
  under the same keys; the driver writes only per-row columns (`rewards`, `sample_mask`);
- GAE runs on the critic's workers (`TQValue.compute_advantages_from_meta`), not on the driver. It needs the
  per-token values, masks and (with the KL in the reward) both logprob columns, all already in the store next to
  those workers; on the driver it would cost a read of those columns and a write of `advantages` and `returns`,
  about as many bytes as the rollout itself. The recursion is row-local; the optional whitening is the only
  batch-wide step and costs three float64 moments per shard (one pass, bit-exact, when there is a single shard).
  Only the `advantages/*`, `returns/mean`, `values/mean` metrics come back;
- `ppo_epochs` of critic and actor updates run from metadata; `finish_step` clears every key of the step and
  fails on any leftover key (every minted key is trained on, or discarded by dynamic sampling when it is on:
  GRPO's filter on the handle's `std` tags, before the critic or the policy reads a row).
Each step logs `train/driver_bytes` (carry + every driver put/get) and `train/store_bytes_written`. The rows come
from a `RolloutSource` (`rollout_sources.ActorSource`: the rollout actor, generating for the step); the loop,
validation and step tail are every trainer's (`runner.py`, `validation.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from relayrl.algorithms.dynamic_sampling import dynamic_sampling_on_meta, group_reward_spread
from relayrl.algorithms.gae import (
    GeneralizedAdvantageEstimator,
    RawRewardAdvantageEstimator,
    build_ppo_advantage_estimator,
    require_valid_tokens,
)
from relayrl.algorithms.interfaces import LossFunction
from relayrl.algorithms.protocols import (
    BatchLoader,
    DataPlanePolicy,
    DataPlaneValue,
    Generation,
    RolloutActor,
    RolloutSource,
    Tokenizer,
)
from relayrl.algorithms.recording import TIMER as RECORD_TIMER
from relayrl.algorithms.recording import StepRecorder
from relayrl.algorithms.reward_functions import post_process_rewards
from relayrl.algorithms.rollout_sources import ActorSource, RolloutSpec, StepStart
from relayrl.algorithms.runner import LoopParts, StepOutput, run_loop
from relayrl.algorithms.trainer_common import (
    KvScaleSync,
    PolicyAndCritic,
    carry_sample_rows,
    guard_finite,
    guard_rewards,
    ppo_epochs,
    ppo_step_metrics,
    rollout_carry_keys,
    worker_seq_logprob_error_metrics,
)
from relayrl.algorithms.validation import Envs, ValidationResult, sync_validator, validation_runner
from relayrl.config import MasterConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.schema import DP_TRAIN_FIELDS, PREV_LOGPROBS, REFERENCE_POLICY_LOGPROBS, REWARDS
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.ray_rollout import rollout_actor_cls
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState
from relayrl.utils.logger import Logger
from relayrl.utils.timer import Timer

__all__ = ["PPOSyncSteps", "ppo_train_sync"]

_CARRY = ["total_reward", "loss_multiplier", "truncated", "length", "loss_token_counts"]


def ppo_train_sync(
    policy: DataPlanePolicy,
    policy_generation: Generation,
    value: DataPlaneValue,
    dataloader: BatchLoader,
    val_dataloader: BatchLoader | None,
    tokenizer: Tokenizer,
    loss_fn: LossFunction,
    value_loss_fn: LossFunction,
    task_to_env: Envs,
    val_task_to_env: Envs | None,
    logger: Logger,
    checkpointer: CheckpointManager,
    save_state: GRPOSaveState,
    master_config: MasterConfig,
) -> dict[str, object]:
    """Run PPO through the data plane. Same signature, stopping rules and metrics as `ppo.ppo_train`."""
    cfg, timer = master_config, Timer()
    _check_components(cfg, policy, value)
    actor: RolloutActor = rollout_actor_cls(cfg)(policy_generation, tokenizer, task_to_env, cfg, cfg.data_plane)

    validate_at = sync_validator(actor, policy, val_dataloader, val_task_to_env, cfg, logger)
    kv_sync = KvScaleSync(policy, policy_generation, timer, tokenizer.pad_token_id, val_dataloader)
    base = [*_CARRY, "prompt_group"] if cfg.ppo.use_dynamic_sampling else _CARRY  # the groups the filter judges
    carry_keys = rollout_carry_keys(base, cfg.ppo.reward_shaping.enabled, cfg.logger.num_train_samples_to_log)
    spec = RolloutSpec(
        value.tq_partition_id, cfg.ppo.num_generations_per_prompt, carry_keys, cfg.logger.num_train_samples_to_log
    )
    source = ActorSource(
        actor, policy_generation, kv_sync, timer, spec, _step_start(policy, value, cfg.ppo.rows_per_step)
    )
    steps = PPOSyncSteps(
        policy, policy_generation, value, source, loss_fn, value_loss_fn, logger, cfg, timer, validate_at, kv_sync
    )
    both = PolicyAndCritic(policy, value)
    return run_loop(steps, LoopParts(cfg, save_state, timer, dataloader, both, policy_generation, checkpointer, logger))


class PPOSyncSteps:
    """The data-plane PPO step: each phase a method under its timer, phase for phase with `ppo.PPOSteps`. Its rows
    come from a `RolloutSource` (the run's rollout actor, generating for the step)."""

    def __init__(
        self,
        policy: DataPlanePolicy,
        policy_generation: Generation,
        value: DataPlaneValue,
        source: RolloutSource,
        loss_fn: LossFunction,
        value_loss_fn: LossFunction,
        logger: Logger,
        cfg: MasterConfig,
        timer: Timer,
        validate_at: Callable[[int], ValidationResult],
        kv_sync: KvScaleSync,
    ) -> None:
        self.policy, self.generation, self.value, self.source = policy, policy_generation, value, source
        self.kv_sync = kv_sync
        self.loss_fn, self.value_loss_fn = loss_fn, value_loss_fn
        self.logger, self.cfg, self.p, self.timer = logger, cfg, cfg.ppo, timer
        self.estimator: GeneralizedAdvantageEstimator | RawRewardAdvantageEstimator = build_ppo_advantage_estimator(
            cfg.ppo.adv_estimator, cfg.loss_fn
        )
        self.skip_ref = not cfg.reference_model_needed
        self.train_fields = [f for f in DP_TRAIN_FIELDS if not (self.skip_ref and f == REFERENCE_POLICY_LOGPROBS)]
        if cfg.loss_fn.positive_example_nll_weight > 0:  # the loss's NLL term reads each row's reward, as legacy's does
            self.train_fields.append(REWARDS)
        self.kl_fields = _kl_logprob_fields(cfg, self.skip_ref)
        self._validate = validation_runner(policy_generation, logger, validate_at, before=kv_sync.before_validation)
        self.recorder = StepRecorder(cfg, logger.run_dir, "data_plane")
        # dynamic sampling collects groups (their keys stay in the store) across generation batches
        self.pending_meta: KVBatchMeta | None = None
        self.pending_carry: BatchedDataDict | None = None
        self.pending_rewards: list[torch.Tensor] = []
        self.num_gen_batches, self.carry_bytes, self.skipped = 0, 0, 0

    def close(self) -> None:
        self.source.close()

    def validate(self, step: int) -> dict[str, float]:
        with self.source.validating():
            return self._validate(step)

    def step(self, batch: BatchedDataDict, step: int) -> StepOutput | None:
        timer, p, policy, value = self.timer, self.p, self.policy, self.value
        self.num_gen_batches += 1
        rollout = self.source.next(
            batch, step, first_batch=self.num_gen_batches == 1, step_starts=self.pending_meta is None
        )
        self.carry_bytes += rollout.carry_bytes  # what crossed to the driver: the carry's smallest exact form
        meta, carry, rollout_metrics = rollout.meta, rollout.carry, rollout.metrics
        with timer.time("reward_calculation"):
            carry["total_reward"], drop = guard_rewards(
                carry["total_reward"], p.num_generations_per_prompt, self.cfg, step
            )
            if drop is not None:  # non_finite: skip; the rows' sample_mask is zeroed with overlong filtering
                carry["non_finite_drop"] = drop
                self.skipped += int(drop.sum())
            elif p.use_dynamic_sampling:  # every generation batch's carry has the key, so survivors concatenate
                carry["non_finite_drop"] = torch.zeros_like(carry["loss_multiplier"], dtype=torch.bool)
            lengths = functools.partial(carry.__getitem__, "response_token_lengths")
            rewards, unshaped = post_process_rewards(carry["total_reward"], carry["truncated"], lengths, p)  # [B]
        reward_for_log = rewards  # [B] every reward generated for the step
        ds_metrics: dict[str, float] = {}
        if p.use_dynamic_sampling:
            with timer.time("dynamic_sampling"):  # filter on tags without fetching; dropped keys leave the store
                done = self._dynamic_sampling(meta, carry, rewards, unshaped)
            if done is None:
                return None
            meta, carry, reward_for_log, ds_metrics = done
            rewards = carry["filtered_reward"]  # [B]
        with timer.time("data_processing"):  # the workers read the per-row sample mask and rewards from the store
            sample_mask, filter_metrics = self._filter(meta, carry, rewards)
        with timer.time("value_inference"):  # values and logprobs: computed and written back by the workers
            value.prepare_for_inference()
            value.get_values_from_meta(meta, timer=timer)
            value.finish_inference()
        with timer.time("prev_logprobs"):
            policy.prepare_for_lp_inference()
            policy.get_logprobs_from_meta(meta, timer=timer)
        with timer.time("reference"):
            if not self.skip_ref:
                policy.get_reference_policy_logprobs_from_meta(meta, timer=timer)
        with timer.time("prev_logprobs"):
            new_mask, seq_err_metrics = worker_seq_logprob_error_metrics(
                policy, meta, sample_mask, rewards, p.seq_logprob_error_threshold
            )
        with timer.time("advantage_calculation"):  # GAE on the critic's workers, written back as columns
            require_valid_tokens(carry["loss_token_counts"] * (new_mask != 0))  # [B] loss tokens per row
            if not torch.equal(new_mask, sample_mask):
                value.write_to_dataplane(meta, {"sample_mask": new_mask})
            adv_metrics = value.compute_advantages_from_meta(
                meta, self.estimator, logprob_fields=self.kl_fields, timer=timer
            )
            guard_finite("advantages", list(adv_metrics.values()), step)
        train_policy, critic_metrics, metrics = ppo_epochs(
            timer,
            p,
            step,
            value,
            lambda: value.train_from_meta(meta, self.value_loss_fn, timer=timer),
            policy,
            lambda: policy.train_from_meta(meta, self.loss_fn, timer=timer, train_fields=self.train_fields),
        )
        self.kv_sync.after_training(
            lambda: policy.read_from_dataplane(meta, select_fields=["input_ids", "input_lengths"])
        )
        if self.recorder.due(step):  # the actor joins its rows with the store's columns (values and returns too)
            with timer.time(RECORD_TIMER):
                fields = [*self.train_fields, "values", "returns"]
                info = self.recorder.info(step, rollout_metrics)
                self.source.record(
                    meta, self.recorder.request(step, fields, self.recorder.driver_columns(step, rewards), info)
                )
        with timer.time("data_plane"):
            value.finish_step(meta)  # clears every key of the step; a leftover key is an error
            dp_metrics = _step_bytes(policy, value, self.source, self.carry_bytes)
        with timer.time("logging"):  # the step's metrics and sample rows
            metrics.update(
                driver_bytes=dp_metrics["data_plane/step/driver_bytes"],
                store_bytes_written=dp_metrics["data_plane/step/store_bytes_written"],
                driver_fraction_of_store_bytes=dp_metrics["data_plane/step/driver_fraction_of_store_bytes"],
                **ppo_step_metrics(
                    reward_for_log,
                    carry["length"],
                    float(sum(meta.sequence_lengths or [])),
                    train_policy,
                    adv_metrics,
                    rollout_metrics,
                    seq_err_metrics,
                    filter_metrics,
                    ds_metrics,
                    carry.get("filtered_reward"),
                ),
            )
            self.logger.log_metrics(dp_metrics, step)
            samples = carry_sample_rows(carry, rewards, step, self.cfg.logger.num_train_samples_to_log)
            self.logger.log_metrics(critic_metrics, step, prefix="critic")
            if self.skipped:
                metrics["non_finite_samples_skipped"], self.skipped = float(self.skipped), 0
            self.num_gen_batches, self.carry_bytes = 0, 0
        metrics.update(self.source.after_step(step))
        dp_seconds = dp_metrics.get("data_plane/all/ms_total", 0.0) / 1e3
        return StepOutput(metrics, samples, {"critic": critic_metrics}, data_plane_seconds=dp_seconds)

    def _dynamic_sampling(
        self, meta: KVBatchMeta, carry: BatchedDataDict, rewards: torch.Tensor, unshaped: torch.Tensor | None
    ) -> tuple[KVBatchMeta, BatchedDataDict, torch.Tensor, dict[str, float]] | None:
        """GRPO's filter on this generation batch, its groups' std stamped on the handle (judged on the unshaped
        rewards when shaping ran). Returns the step's (meta, carry, every reward generated for it, metrics) once
        enough rows survived, else None (the next loader batch is generated)."""
        carry["total_reward"] = rewards  # [B] shaped: what the kept rows train on (their filtered_reward)
        _, std = group_reward_spread(carry["prompt_group"].unsqueeze(-1), rewards, unshaped)  # [B]
        meta.stamp_tags({"std": std.tolist()})
        self.pending_meta, self.pending_carry, self.pending_rewards, complete, ds_metrics, unfiltered = (
            dynamic_sampling_on_meta(
                meta=meta,
                driver_carry=carry,
                pending_meta=self.pending_meta,
                pending_carry=self.pending_carry,
                pending_unfiltered_rewards=self.pending_rewards,
                train_prompts_size=self.p.rows_per_step,
                num_gen_batches=self.num_gen_batches,
                max_gen_batches=self.p.dynamic_sampling_max_gen_batches,
                policy=self.policy,  # shares the critic's partition: drops the filtered keys from it
                section="ppo",
            )
        )
        if not complete:
            return None
        assert self.pending_meta is not None and self.pending_carry is not None and unfiltered is not None
        out = (self.pending_meta, self.pending_carry, unfiltered, ds_metrics)
        self.pending_meta, self.pending_carry = None, None
        return out

    def _filter(
        self, meta: KVBatchMeta, carry: BatchedDataDict, rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Overlong filtering; per-row rewards (and the mask, if it changed) go to the store. Returns the mask [B]."""
        sample_mask = carry["loss_multiplier"].clone().float()  # [B]
        if "non_finite_drop" in carry:
            sample_mask[carry["non_finite_drop"]] = 0.0
        truncated = carry["truncated"].bool()  # [B]
        num_filtered = 0
        if self.p.overlong_filtering:
            num_filtered = int((truncated & (sample_mask > 0)).sum())
            sample_mask[truncated] = 0.0
        columns = {"rewards": rewards.float()}  # [B]
        if not torch.equal(sample_mask, carry["loss_multiplier"]):
            columns["sample_mask"] = sample_mask  # [B]
        self.value.write_to_dataplane(meta, columns)
        return sample_mask, {"num_overlong_filtered": float(num_filtered)}


def _check_components(cfg: MasterConfig, policy: DataPlanePolicy, value: DataPlaneValue) -> None:
    if cfg.algorithm != "ppo":
        raise ValueError(f"ppo_train_sync needs algorithm: ppo, got {cfg.algorithm!r}")
    if not cfg.data_plane.enabled:
        raise ValueError("ppo_train_sync needs data_plane.enabled=true; use ppo.ppo_train (the legacy trainer)")
    if value.tq_partition_id != policy.tq_partition_id:
        raise ValueError(
            f"the policy and the critic must share one partition ({policy.tq_partition_id!r} vs "
            f"{value.tq_partition_id!r})"
        )


def _kl_logprob_fields(cfg: MasterConfig, skip_ref: bool) -> tuple[str, ...]:
    """The logprob columns GAE reads: both when the KL is in the reward (a skipped reference reads as zeros)."""
    if not (cfg.loss_fn.use_kl_in_reward and cfg.loss_fn.reference_policy_kl_penalty > 0):
        return ()
    return (PREV_LOGPROBS,) if skip_ref else (PREV_LOGPROBS, REFERENCE_POLICY_LOGPROBS)


def _step_start(policy: DataPlanePolicy, value: DataPlaneValue, rows: int) -> StepStart:
    """Before a PPO step's rows reach the store: the byte counters of every client start over (validation traffic
    is not the step's) and the critic prepares the partition (the PPO schema: GRPO's fields plus values, returns,
    rewards)."""

    def start(rollout_counters: dict[str, float]) -> None:
        policy.data_plane_metrics(reset=True, extra=[rollout_counters])
        value.data_plane_metrics(reset=True)
        value.prepare_step(rows)

    return start


def _step_bytes(
    policy: DataPlanePolicy, value: DataPlaneValue, source: RolloutSource, carry_bytes: int
) -> dict[str, float]:
    """The policy's `data_plane/*` metrics over every client of the step (policy driver and workers, rollout actor,
    critic driver and workers) plus `data_plane/step/*`: bytes through the driver (carry + the two driver clients'
    puts and gets) and bytes written to the store by anyone."""
    critic = value.data_plane_metrics(reset=True)
    critic_workers = {
        "data_plane/put/bytes": critic.pop("data_plane/workers/put_bytes", 0.0),
        "data_plane/get/bytes": critic.pop("data_plane/workers/get_bytes", 0.0),
    }
    out = policy.data_plane_metrics(reset=True, extra=[source.store_metrics(), critic, critic_workers])
    out["data_plane/driver_bytes"] = out.get("data_plane/driver_bytes", 0.0) + critic.get(
        "data_plane/driver_bytes", 0.0
    )
    driver = out["data_plane/driver_bytes"] + carry_bytes
    written = out.get("data_plane/all/put_bytes", 0.0)
    out["data_plane/driver_fraction_of_written"] = out["data_plane/driver_bytes"] / written if written else 0.0
    out["data_plane/step/driver_bytes"] = float(driver)
    out["data_plane/step/store_bytes_written"] = float(written)
    out["data_plane/step/driver_fraction_of_store_bytes"] = float(driver) / max(written, 1.0)
    return out

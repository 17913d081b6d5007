"""GRPO, data-plane path: rollout tensors live in a sample-keyed store; the driver handles metadata and per-row scalars.

Sibling of `grpo.py`, phase for phase (same timers, same order, same shared helpers), so the two read side by side
and log identical metrics. What differs is only where data lives:
- the rollout actor writes the bulk (`input_ids`, `generation_logprobs`, `token_mask`, `sample_mask`) once, under
  keys minted at rollout, and returns a small per-row carry (rewards, lengths, group ids);
- logprob and training dispatches hand each data-parallel worker a slice of the keys; workers fetch their rows and
  write per-token results (`prev_logprobs`, `reference_policy_logprobs`) back under the same keys;
- the driver writes per-row columns (`advantages`, `sample_mask`) and clears every key at the end of the step.
Where the rows come from is `GRPOSyncSteps`'s `RolloutSource`, so this one class is every data-plane GRPO trainer:
the rollout actor generating for the step (`rollout_sources.ActorSource`, here), the asynchronous producer's batch
made ahead (`producer_source.ProducerSource`, `grpo_async`), or a flight recording (`replay.RecordedSource`).
Dynamic sampling filters on metadata across generation batches (`dynamic_sampling`).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable

import torch

from relayrl.algorithms.advantages import (
    GRPOAdvantageEstimator,
    advantage_metrics,
    apply_advantage_overrides,
    build_advantage_estimator,
    clip_advantages,
    message_level_advantage_keys,
    message_level_advantages,
    row_advantage_metrics,
)
from relayrl.algorithms.dynamic_sampling import apply_dynamic_sampling
from relayrl.algorithms.interfaces import LossFunction
from relayrl.algorithms.logprob_error import compute_seq_logprob_error_metrics
from relayrl.algorithms.protocols import (
    BatchLoader,
    DataPlanePolicy,
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
    carry_sample_rows,
    guard_finite,
    guard_rewards,
    guard_update,
    resolve_logprob_skip_flags,
    rollout_carry_keys,
    step_metrics,
    worker_seq_logprob_error_metrics,
)
from relayrl.algorithms.utils import calculate_baseline_and_std_per_prompt
from relayrl.algorithms.validation import Envs, ValidationResult, sync_validator, validate_sync, validation_runner
from relayrl.config import MasterConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.schema import ADVANTAGE_OVERRIDE, DP_TRAIN_FIELDS
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.ray_rollout import rollout_actor_cls  # SyncRolloutActor, or a Ray actor on Ray
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState
from relayrl.utils.logger import Logger
from relayrl.utils.timer import Timer

__all__ = [
    "GRPOSyncSteps",
    "_apply_dynamic_sampling",
    "_compute_seq_logprob_error_metrics",
    "_raise_if_message_level_advantage_penalties_enabled",
    "grpo_rollout_spec",
    "grpo_step_start",
    "grpo_train_sync",
    "raise_if_message_level_advantage_penalties_enabled",
    "validate_sync",
]

_CARRY = ["total_reward", "loss_multiplier", "truncated", "length", "prompt_group", "loss_token_counts"]


def grpo_train_sync(
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
    """Run GRPO through the data plane. Same signature, stopping rules and metrics as `grpo.grpo_train`."""
    cfg = master_config
    if not cfg.data_plane.enabled:
        raise ValueError("grpo_train_sync needs data_plane.enabled=true; use grpo.grpo_train (the legacy trainer)")
    timer = Timer()
    actor: RolloutActor = rollout_actor_cls(cfg)(policy_generation, tokenizer, task_to_env, cfg, cfg.data_plane)

    validate_at = sync_validator(actor, policy, val_dataloader, val_task_to_env, cfg, logger)
    kv_sync = KvScaleSync(policy, policy_generation, timer, tokenizer.pad_token_id, val_dataloader)
    source = ActorSource(
        actor, policy_generation, kv_sync, timer, grpo_rollout_spec(cfg, policy), grpo_step_start(policy, cfg)
    )
    steps = GRPOSyncSteps(policy, policy_generation, source, loss_fn, logger, cfg, timer, validate_at, kv_sync)
    parts = LoopParts(cfg, grpo_save_state, timer, wrapped_dataloader, policy, policy_generation, checkpointer, logger)
    return run_loop(steps, parts)


def grpo_rollout_spec(cfg: MasterConfig, policy: DataPlanePolicy) -> RolloutSpec:
    """A GRPO step's rows: the policy's partition, G per prompt, the carry its phases read."""
    g = cfg.grpo
    carry_keys = rollout_carry_keys(_CARRY, g.reward_shaping.enabled, cfg.logger.num_train_samples_to_log)
    return RolloutSpec(
        policy.tq_partition_id, g.num_generations_per_prompt, carry_keys, cfg.logger.num_train_samples_to_log
    )


def grpo_step_start(policy: DataPlanePolicy, cfg: MasterConfig) -> StepStart:
    """Before a GRPO step's first rows reach the store: the policy's byte counters start over (with the rollout
    side's) and its partition is prepared for the step's rows."""
    g = cfg.grpo

    def start(rollout_counters: dict[str, float]) -> None:
        policy.data_plane_metrics(reset=True, extra=[rollout_counters])
        policy.prepare_step(num_samples=g.rows_per_step, group_size=g.num_generations_per_prompt)

    return start


class GRPOSyncSteps:
    """The data-plane GRPO step: each phase a method under its timer, phase for phase with `grpo.GRPOSteps`. Its
    rows come from a `RolloutSource` (generated for the step, made ahead by the async producer, or recorded)."""

    def __init__(
        self,
        policy: DataPlanePolicy,
        policy_generation: Generation,
        source: RolloutSource,
        loss_fn: LossFunction,
        logger: Logger,
        cfg: MasterConfig,
        timer: Timer,
        validate_at: Callable[[int], ValidationResult],
        kv_sync: KvScaleSync,
    ) -> None:
        self.policy, self.generation, self.source, self.loss_fn = policy, policy_generation, source, loss_fn
        self.kv_sync = kv_sync
        self.logger, self.cfg, self.g, self.timer = logger, cfg, cfg.grpo, timer
        self.estimator = build_advantage_estimator(cfg.grpo, cfg.loss_fn)
        self.flag_to_adv = message_level_advantages(cfg)  # the rollout stores their per-token overrides
        self.skip_prev, self.skip_ref = resolve_logprob_skip_flags(cfg)
        self.train_fields = _train_fields_for_step(self.skip_prev, self.skip_ref)
        self._validate = validation_runner(policy_generation, logger, validate_at, before=kv_sync.before_validation)
        self.recorder = StepRecorder(cfg, logger.run_dir, "data_plane")
        # dynamic sampling collects groups (their keys stay in the store) across generation batches
        self.pending_meta: KVBatchMeta | None = None
        self.pending_carry: BatchedDataDict | None = None
        self.pending_rewards: list[torch.Tensor] = []
        self.num_gen_batches, self.carry_bytes = 0, 0

    def close(self) -> None:
        self.source.close()

    def validate(self, step: int) -> dict[str, float]:
        with self.source.validating():
            return self._validate(step)

    def step(self, batch: BatchedDataDict, step: int) -> StepOutput | None:
        timer, g = self.timer, self.g
        self.num_gen_batches += 1
        rollout = self.source.next(
            batch, step, first_batch=self.num_gen_batches == 1, step_starts=self.pending_meta is None
        )
        self.carry_bytes += rollout.carry_bytes  # what crossed to the driver: the carry's smallest exact form
        meta, carry, rollout_metrics = rollout.meta, rollout.carry, rollout.metrics
        with timer.time("reward_calculation"):  # on the carry only
            carry["total_reward"], drop = guard_rewards(
                carry["total_reward"], g.num_generations_per_prompt, self.cfg, step
            )
            if drop is not None:  # non_finite: skip; the rows' sample_mask is zeroed with overlong filtering
                carry["non_finite_drop"] = drop
            rewards = self._rewards(meta, carry)
        ds_metrics: dict[str, float] = {}
        with timer.time("dynamic_sampling"):  # filter on tags without fetching; dropped keys leave the store at once
            if g.use_dynamic_sampling:
                done = self._dynamic_sampling(meta, carry)
                if done is None:
                    return None
                meta, carry, reward_for_log, ds_metrics = done
            else:
                reward_for_log = rewards
        rewards = carry.get("filtered_reward", carry["total_reward"])
        with timer.time("data_processing"):  # overlong filtering: the store gets the per-row mask if it changed
            sample_mask, stored_mask = self._sample_mask(meta, carry)
        with timer.time("prev_logprobs"):  # computed and written back by the workers
            if not (self.skip_prev and self.skip_ref):
                self.policy.prepare_for_lp_inference()
            if not self.skip_prev:
                self.policy.get_logprobs_from_meta(meta, timer=timer)
        with timer.time("reference"):
            if not self.skip_ref and not rollout.reference_in_store:
                self.policy.get_reference_policy_logprobs_from_meta(meta, timer=timer)
        seq_err_metrics: dict[str, float] = {}
        if not self.skip_prev:  # reduced per row on the workers: [B] floats reach the driver, not [B, S] columns
            with timer.time("prev_logprobs"):
                sample_mask, seq_err_metrics = worker_seq_logprob_error_metrics(
                    self.policy, meta, sample_mask, rewards, g.seq_logprob_error_threshold
                )
        with timer.time("advantage_calculation"):
            adv_metrics = self._advantages(meta, carry, rewards, sample_mask, stored_mask)
            guard_finite("advantages", list(adv_metrics.values()), step)
        with timer.time("policy_training"):  # every DP worker fetches its keys
            self.policy.prepare_for_training()
            train_results = self.policy.train_from_meta(meta, self.loss_fn, timer=timer, train_fields=self.train_fields)
            guard_update(train_results, step)
            self.policy.finish_training()
        self.kv_sync.after_training(
            lambda: self.policy.read_from_dataplane(meta, select_fields=["input_ids", "input_lengths"])
        )
        if self.recorder.due(step):  # the actor joins its rows with the store's columns: nothing bulk crosses here
            with timer.time(RECORD_TIMER):
                cols = self.recorder.driver_columns(step, rewards, carry["baseline"], carry["std"])
                request = self.recorder.request(
                    step, self.train_fields, cols, self.recorder.info(step, rollout_metrics)
                )
                self.source.record(meta, request)
        with timer.time("data_plane"):
            self.policy.finish_step(meta)  # clears every key of the step; a leftover key is an error
        with timer.time("logging"):  # the step's metrics
            metrics = step_metrics(
                train_results=train_results,
                reward_for_log=reward_for_log,
                filtered_reward=carry.get("filtered_reward"),
                prompt_lengths=carry["length"],
                input_lengths=torch.tensor(meta.sequence_lengths or [], dtype=torch.long),
                adv_metrics=adv_metrics,
                rollout_metrics=rollout_metrics,
                seq_err_metrics=seq_err_metrics,
                ds_metrics=ds_metrics,
            )
        with timer.time("data_plane"):  # the step's store counters, merged over every client
            dp_metrics = self._byte_metrics(meta, metrics)
        dp_seconds = dp_metrics.get("data_plane/all/ms_total", 0.0) / 1e3  # for data_plane/share_of_step
        with timer.time("logging"):  # and its sample rows
            self.logger.log_metrics(dp_metrics, step)
            if "non_finite_drop" in carry:
                metrics["non_finite_samples_skipped"] = float(carry["non_finite_drop"].sum())
            self.num_gen_batches, self.pending_rewards, self.carry_bytes = 0, [], 0
            samples = carry_sample_rows(carry, rewards, step, self.cfg.logger.num_train_samples_to_log)
        metrics.update(self.source.after_step(step))  # async: weights published, the batch's partition retired
        return StepOutput(metrics, samples, data_plane_seconds=dp_seconds)

    def _rewards(self, meta: KVBatchMeta, carry: BatchedDataDict) -> torch.Tensor:
        """Scaling/shaping, then the per-prompt baseline and std, stamped on the handle's tags. Returns rewards [B]."""
        g = self.g
        rewards, unshaped = post_process_rewards(
            carry["total_reward"],
            carry["truncated"],
            functools.partial(carry.__getitem__, "response_token_lengths"),
            g,
        )
        carry["total_reward"] = rewards
        baseline, std = calculate_baseline_and_std_per_prompt(
            carry["prompt_group"].unsqueeze(-1),
            rewards,
            torch.ones_like(rewards),
            leave_one_out_baseline=g.use_leave_one_out_baseline,
            std_rewards=unshaped if (unshaped is not None and g.use_dynamic_sampling) else None,
        )
        carry["baseline"], carry["std"] = baseline, std
        meta.stamp_tags({"std": std.tolist(), "baseline": baseline.tolist()})
        return rewards

    def _dynamic_sampling(
        self, meta: KVBatchMeta, carry: BatchedDataDict
    ) -> tuple[KVBatchMeta, BatchedDataDict, torch.Tensor, dict[str, float]] | None:
        """One dynamic-sampling iteration; the training batch once enough groups survived, else None."""
        self.pending_meta, self.pending_carry, self.pending_rewards, complete, ds_metrics, unfiltered = (
            apply_dynamic_sampling(
                meta=meta,
                driver_carry=carry,
                pending_meta=self.pending_meta,
                pending_carry=self.pending_carry,
                pending_unfiltered_rewards=self.pending_rewards,
                train_prompts_size=self.g.rows_per_step,
                num_gen_batches=self.num_gen_batches,
                max_gen_batches=self.g.dynamic_sampling_max_gen_batches,
                policy=self.policy,
            )
        )
        if not complete:
            return None
        assert self.pending_meta is not None and self.pending_carry is not None and unfiltered is not None
        out = (self.pending_meta, self.pending_carry, unfiltered, ds_metrics)
        self.pending_meta, self.pending_carry = None, None
        return out

    def _sample_mask(self, meta: KVBatchMeta, carry: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor]:
        """Overlong filtering on the per-row mask. Returns (sample_mask, what the store holds), both [B]."""
        sample_mask = carry["loss_multiplier"].clone().float()  # [B]
        if "non_finite_drop" in carry:
            sample_mask[carry["non_finite_drop"]] = 0.0
        if self.g.overlong_filtering:
            sample_mask[carry["truncated"].bool()] = 0.0
        stored_mask = carry["loss_multiplier"].float()  # [B] what the store's sample_mask holds
        if not torch.equal(sample_mask, stored_mask):
            self.policy.write_to_dataplane(meta, {"sample_mask": sample_mask})
            stored_mask = sample_mask.clone()
        return sample_mask, stored_mask

    def _advantages(
        self,
        meta: KVBatchMeta,
        carry: BatchedDataDict,
        rewards: torch.Tensor,
        sample_mask: torch.Tensor,
        stored_mask: torch.Tensor,
    ) -> dict[str, float]:
        """Advantages (+ clipping) written to the store. GRPO's are per row, so only [B] floats go back; per-token
        estimators need the token mask on the driver (and cost per-token bytes)."""
        g = self.g
        valid_counts = carry["loss_token_counts"].long() * (sample_mask != 0)  # [B] loss tokens per row
        prompt_group = carry["prompt_group"].unsqueeze(-1)  # [B, 1]
        if self.flag_to_adv:  # message-level penalties: per-token advantages, as the legacy trainer computes them
            fields = [*_token_fields(self.skip_prev, self.skip_ref), ADVANTAGE_OVERRIDE]
            cols = self.policy.read_from_dataplane(meta, select_fields=fields)
            mask = cols["token_mask"] * sample_mask.unsqueeze(-1)  # [B, S]
            column = self.estimator.compute_advantage(
                prompt_group, rewards, mask, cols.get("prev_logprobs"), cols.get("reference_policy_logprobs")
            )
            overrides = cols[ADVANTAGE_OVERRIDE].float()  # [B, S]; past a row's length: keep the estimator's
            lengths = torch.tensor(meta.sequence_lengths, dtype=torch.long)  # [B]
            overrides[torch.arange(overrides.shape[1]).unsqueeze(0) >= lengths.unsqueeze(1)] = float("nan")
            column = apply_advantage_overrides(column, overrides)
            column = clip_advantages(column, g.advantage_clip_low, g.advantage_clip_high)  # [B, S]
            adv_metrics = advantage_metrics(column, mask, carry["baseline"])
        elif isinstance(self.estimator, GRPOAdvantageEstimator):
            adv_rows = self.estimator.compute_advantage(prompt_group, rewards, sample_mask.unsqueeze(-1))[:, 0]
            column = clip_advantages(adv_rows, g.advantage_clip_low, g.advantage_clip_high)  # [B]
            width = int(meta.extra_info.get("global_forward_pad_seqlen") or max(meta.sequence_lengths or [0]))
            adv_metrics = row_advantage_metrics(column, valid_counts, carry["baseline"], width)
        else:
            cols = self.policy.read_from_dataplane(meta, select_fields=_token_fields(self.skip_prev, self.skip_ref))
            mask = cols["token_mask"] * sample_mask.unsqueeze(-1)  # [B, S]
            column = self.estimator.compute_advantage(
                prompt_group, rewards, mask, cols.get("prev_logprobs"), cols.get("reference_policy_logprobs")
            )
            column = clip_advantages(column, g.advantage_clip_low, g.advantage_clip_high)  # [B, S]
            adv_metrics = advantage_metrics(column, mask, carry["baseline"])
        columns = {"advantages": column}
        if not torch.equal(sample_mask, stored_mask):  # else the store already holds it
            columns["sample_mask"] = sample_mask
        self.policy.write_to_dataplane(meta, columns)
        return adv_metrics

    def _byte_metrics(self, meta: KVBatchMeta, metrics: dict[str, float]) -> dict[str, float]:
        """Bytes through the driver (carry + driver puts/gets) against bytes written to the store, and the handle.
        Returns the step's `data_plane/*` metrics."""
        dp_metrics = self.policy.data_plane_metrics(reset=True, extra=[self.source.store_metrics()])
        metrics["driver_bytes"] = float(dp_metrics.get("data_plane/driver_bytes", 0.0) + self.carry_bytes)
        metrics["store_bytes_written"] = float(dp_metrics.get("data_plane/all/put_bytes", 0.0))
        metrics["driver_fraction_of_store_bytes"] = metrics["driver_bytes"] / max(metrics["store_bytes_written"], 1.0)
        # the handle itself (keys, lengths, tags) is control-plane metadata, reported apart from the payload
        metrics["driver_meta_bytes"] = float(len(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)))
        return dp_metrics


def raise_if_message_level_advantage_penalties_enabled(master_config: MasterConfig) -> None:
    """Raise NotImplementedError naming the message-level advantage penalty keys set (`grpo.invalid_tool_call_advantage`,
    `grpo.malformed_thinking_advantage`, or their `reward_penalties.*` spellings): the reference's refusal on its
    asynchronous trainer. Here asynchronous GRPO applies them on both executors (its producer's rows carry the
    per-token overrides, as the synchronous trainers' do): kept for the reference's name."""
    keys = message_level_advantage_keys(master_config)
    if keys:
        names = ", ".join(keys)
        raise NotImplementedError(
            f"message-level advantage penalties ({names}) are not supported by asynchronous GRPO with "
            "data_plane.enabled=true; disable them or use a synchronous trainer (grpo.async_grpo.enabled=false)"
        )


_raise_if_message_level_advantage_penalties_enabled = (
    raise_if_message_level_advantage_penalties_enabled  # reference name
)
_apply_dynamic_sampling = apply_dynamic_sampling  # reference name


def _train_fields_for_step(skip_prev_logprobs: bool, skip_reference_logprobs: bool = False) -> list[str]:
    """DP_TRAIN_FIELDS minus the logprob columns this step skipped (workers zero-fill them, as the legacy path)."""
    skipped = {"prev_logprobs"} if skip_prev_logprobs else set()
    if skip_reference_logprobs:
        skipped.add("reference_policy_logprobs")
    return [f for f in DP_TRAIN_FIELDS if f not in skipped]


def _token_fields(skip_prev: bool, skip_ref: bool) -> list[str]:
    return (
        ["token_mask"] + ([] if skip_prev else ["prev_logprobs"]) + ([] if skip_ref else ["reference_policy_logprobs"])
    )


def _compute_seq_logprob_error_metrics(
    *,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    seq_logprob_error_threshold: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The legacy trainer's sequence-level logprob-error metrics and threshold masking, from the step's columns.

    `token_mask`, `prev_logprobs`, `generation_logprobs` are [B, S] (token-aligned), `sample_mask` and `rewards`
    [B]. Returns (sample_mask, metrics): the mask with rows whose error exceeds the threshold zeroed (unchanged
    without a threshold). `GRPOSyncSteps` gets the same numbers without fetching the columns to the driver
    (`trainer_common.worker_seq_logprob_error_metrics`: each worker reduces its own rows).
    """
    return compute_seq_logprob_error_metrics(
        token_mask, sample_mask, prev_logprobs, generation_logprobs, rewards, seq_logprob_error_threshold
    )

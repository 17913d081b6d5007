"""Asynchronous GRPO's rollout source: each step claims the batch the producer made for it ahead of time.

`ProducerSource` is what makes `GRPOSyncSteps` the asynchronous trainer (`grpo_async.grpo_train_async`): the step's
phases are the synchronous ones, and around them this source
- claims the step's batch from the producer (`async_rollouts.RolloutProducer`): it waits for it (timed as
  `waiting`), confirms it through the store's task-mediated claim in prompt order, and hands over its
  carry, its metrics and whether the producer already wrote the reference log-probs;
- after the step, retires the batch's partition (the step cleared its keys), publishes the new weights to the
  producer (copied only when a future batch will use them) and reports the samples' age (`async/*`);
- records a step through the trainer's own rollout actor (the producer's actor holds the rows: on Ray they came with
  the batch), checkpoints the unconsumed batches with the producer (`save_state`), and at the end stops it.
`ProducerSide` is what the producer generates with, built per executor by `grpo_async`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relayrl.algorithms.async_rollouts import (
    CLAIM_TASK,
    ProducedBatch,
    ProducerEngine,
    ProducerState,
    RolloutProducer,
)
from relayrl.algorithms.async_state import ASYNC_STATE, save_producer_state
from relayrl.algorithms.protocols import BatchLoader, DataPlanePolicy, Rollout, RolloutActor
from relayrl.algorithms.rollout_sources import received
from relayrl.config import MasterConfig
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.data_plane.schema import REFERENCE_POLICY_LOGPROBS
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface
from relayrl.environments.registry import shutdown_all
from relayrl.experience.flight_recorder import RecordRequest, export_rows
from relayrl.experience.ray_rollout import RayRolloutActor
from relayrl.utils.logger import Logger
from relayrl.utils.timer import Timer

__all__ = ["ASYNC_FLIGHT_ROWS", "PinnedSource", "ProducerSide", "ProducerSource"]

#: The flight recorder's rows (text, environment reward) of the batches a checkpoint keeps in flight.
ASYNC_FLIGHT_ROWS = "async_flight_rows.json"


class PinnedSource:
    """The producer engine's model source: the live policy module (copied once, at start) and the weights version
    the engine generates as (set by the producer after each refit)."""

    def __init__(self, model: torch.nn.Module, version: int) -> None:
        self.model, self.weights_version = model, version


@dataclass
class ProducerSide:
    """What the producer generates with, per executor (see `grpo_async`'s module docstring)."""

    engine: ProducerEngine
    actor: RolloutActor
    client: DataPlaneClient  # the producer thread's store client (registers partitions; checkpoints read through it)
    snapshot: Callable[[], dict[str, torch.Tensor]]  # a copy of the weights the trainer just made
    pin: PinnedSource | None = None  # local: the private engine's model source
    ray_actor: RayRolloutActor | None = None  # Ray: the same actor, with its flight-recorder rows out of process
    own_client: bool = False
    envs: list[EnvironmentInterface] = field(default_factory=list)  # local: the producer's own environment copies

    def shutdown(self) -> None:
        """Release the engine, the actor and the environments (their episodes still open: a run that failed)."""
        try:
            self.actor.shutdown()
            self.engine.shutdown()
        finally:
            try:
                shutdown_all(self.envs)
            finally:
                if self.own_client:
                    self.client.close()


class ProducerSource:
    """The asynchronous trainer's rollouts: the producer's batches, claimed one per step (see the module docstring).

    `actor` is the trainer's own rollout actor (validation, recording); this source shuts it down last."""

    def __init__(
        self,
        *,
        policy: DataPlanePolicy,
        actor: RolloutActor,
        side: ProducerSide,
        loader: BatchLoader,
        state: ProducerState,
        dropped_groups: int,
        carry_keys: list[str],
        cfg: MasterConfig,
        timer: Timer,
        logger: Logger,
    ) -> None:
        self.policy, self.actor, self.side, self.cfg, self.timer, self.logger = policy, actor, side, cfg, timer, logger
        self.age_bound = cfg.grpo.async_grpo.max_trajectory_age_steps
        self.skip_ref = not cfg.reference_model_needed  # as `trainer_common.resolve_logprob_skip_flags` has it
        ray_actor = side.ray_actor
        fetch_rows = None
        if ray_actor is not None and cfg.logger.flight_recorder.enabled:

            def fetch_rows(meta: KVBatchMeta) -> dict[str, Any]:
                return ray_actor.export_flight([(meta.partition_id, list(meta.keys))])

        self.producer = RolloutProducer(
            actor=side.actor, engine=side.engine, pin=side.pin, client=side.client, loader=loader, cfg=cfg,
            state=state, carry_keys=carry_keys,
            after_rollout=self._reference_pass if self._reference_in_producer() else None,
            after_rollout_optional=cfg.grpo.async_grpo.reference_pass == "auto",
            initial_weights=side.snapshot() if ray_actor is not None else None,  # Ray's workers: the start version
            flight_rows=fetch_rows,
        )  # fmt: skip
        self.dropped_groups = dropped_groups  # reported with the next step's metrics
        self._batch: ProducedBatch | None = None  # the batch the current step trains on

    def _reference_in_producer(self) -> bool:
        """Under LoRA the reference model is the live module with its adapters off: never beside training."""
        cfg = self.cfg
        return cfg.grpo.async_grpo.reference_pass != "trainer" and not self.skip_ref and not cfg.policy.lora.enabled

    def _reference_pass(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Producer thread: the frozen reference model's log-probs of a fresh batch, written under its keys (the
        policy's reference copy is its own module, untouched by training)."""
        self.policy.get_reference_policy_logprobs_from_meta(meta)
        return meta.with_fields([REFERENCE_POLICY_LOGPROBS])

    # ------------------------------------------------------------------ RolloutSource
    def next(self, batch: BatchedDataDict, step: int, *, first_batch: bool, step_starts: bool) -> Rollout:
        """Wait for the batch made for `step` (exposed generation), confirm it through the store's task-mediated
        claim in prompt order, and take its carry. `batch` (its prompts) was rolled out by the producer already."""
        with self.timer.time("waiting"):  # exposed generation: the producer has not made the batch yet
            produced = self.producer.take(step)
        meta = produced.meta
        with self.timer.time("data_plane"):
            claimed = self.policy.dp_client.claim_meta(
                meta.partition_id, CLAIM_TASK, list(meta.fields or []), meta.size, blocking=False
            )
            if claimed.keys != meta.keys:
                raise RuntimeError(
                    f"async claim of batch {produced.index} returned {claimed.size} keys not in prompt order "
                    f"(expected {meta.size})"
                )
            self.policy.data_plane_metrics(reset=True)  # this step's byte counters start here
        self._batch = produced
        # `reference_pass=auto`: the producer left the pass to this step if the step was already waiting for the batch
        in_store = REFERENCE_POLICY_LOGPROBS in (meta.fields or [])
        with self.timer.time("data_processing"):
            return received(meta, produced.wire_carry, produced.rollout_metrics, reference_in_store=in_store)

    def record(self, meta: KVBatchMeta, request: RecordRequest) -> None:
        """The producer rolled the batch out and holds its rows; the store is read through the trainer's actor (on
        Ray the rows came with the batch: they go to the trainer's actor first)."""
        if self.side.ray_actor is None:
            self.actor.record_step(meta, request, rows_from=self.side.actor)
            return
        assert isinstance(self.actor, RayRolloutActor) and self._batch is not None
        self.actor.import_flight(self._batch.flight_rows or {})
        self.actor.record_step(meta, request)

    def store_metrics(self) -> dict[str, float]:
        assert self._batch is not None
        return self._batch.store_metrics  # counted by the producer for this batch's writes

    def after_step(self, step: int) -> dict[str, float]:
        """Retire the batch's partition (the step emptied it), publish the new weights, and report the samples'
        staleness (and, under `timing/async`, the producer's own clock for the batch)."""
        produced = self._batch
        assert produced is not None  # no dynamic sampling in async mode: every claimed batch completes its step
        with self.timer.time("data_plane"):
            self.policy.dp_client.drop_partition(produced.meta.partition_id)
        self._publish(step)
        metrics = self._staleness_metrics(step, produced)
        producer = {  # overlapped with an earlier step's training
            "producer_generation": produced.generation_s,
            "producer_cpu": produced.generation_cpu_s,  # its thread and its generation process
            "reference_in_producer": float(REFERENCE_POLICY_LOGPROBS in (produced.meta.fields or [])),
            "producer_idle": produced.idle_s,  # waiting for weights (the staleness bound) or for the engine
            "producer_refit": produced.refit_s,
            "producer_environment": produced.environment_s,  # inside producer_generation
            "queue_depth": float(produced.queue_depth),  # batches ready when the step asked (0: it waited)
        }
        with self.timer.time("logging"):
            self.logger.log_metrics(producer, step, prefix="timing/async")
        self._batch = None
        return metrics

    def validating(self) -> AbstractContextManager[None]:
        """On Ray validation generates on the producer's workers: between its batches. Locally it has its own."""
        return self.producer.paused() if self.side.ray_actor is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Stop the producer; batches nobody will train on leave the store and are counted."""
        try:
            left = self.producer.stop()
            if left:
                for b in left:
                    self.policy.discard_samples(b.meta.keys, b.meta.partition_id)
                    self.policy.dp_client.drop_partition(b.meta.partition_id)
                groups = sum(b.meta.size for b in left) // self.cfg.grpo.num_generations_per_prompt
                self.logger.print_message(
                    f"async: {len(left)} generated batch(es) ({groups} groups) not trained on; discarded at shutdown"
                )
        finally:
            try:
                self.side.shutdown()
            finally:
                self.actor.shutdown()

    # ------------------------------------------------------------------ around the step
    def save_state(self, directory: Path) -> None:
        """Checkpoint hook (after the loader's drain): the unconsumed batches with their rows (or, when the checkpoint
        saves the store, just their descriptions: their partitions are in its data_plane/), and the producer."""
        state, rng, _ = self.producer.snapshot()
        in_store = self.cfg.checkpointing.save_data_plane
        save_producer_state(directory / ASYNC_STATE, state, rng, self.side.client, rows_in_store=in_store)
        stash = getattr(self.side.actor, "flight", None)
        rows: dict[str, Any] | None = None  # their flight-recorder rows (text, env reward): a resumed run records them
        if self.side.ray_actor is not None and self.cfg.logger.flight_recorder.enabled:
            rows = {p: r for b in state.ready for p, r in (b.flight_rows or {}).items()}
        elif stash is not None:
            rows = export_rows(stash, [(b.meta.partition_id, b.meta.keys) for b in state.ready])
        if rows is not None:
            (directory / ASYNC_FLIGHT_ROWS).write_text(json.dumps(rows))

    def _publish(self, step: int) -> None:
        """Weights after `step` optimizer steps go to the producer, copied only if a future batch uses them."""
        needed = step + 1 + self.age_bound <= self.cfg.grpo.max_num_steps
        weights = None
        with self.timer.time("refit"):  # the trainer's side of the producer's refit: the snapshot it loads
            if needed:
                weights = self.side.snapshot()
            self.producer.publish(step, weights)

    def _staleness_metrics(self, step: int, produced: ProducedBatch) -> dict[str, float]:
        """Age (trainer version - generating version) of the step's groups, as mean, max and a histogram."""
        age = (step - 1) - produced.version  # every group of a batch shares its version
        out = {
            "async/trajectory_age_mean": float(age),
            "async/trajectory_age_max": float(age),
            "async/off_policy_fraction": 1.0 if age > 0 else 0.0,
            "async/generating_weight_version": float(produced.version),
            "async/dropped_stale_groups": float(self.dropped_groups),
        }
        for a in range(self.age_bound + 1):
            out[f"async/trajectory_age_hist/{a}"] = 1.0 if age == a else 0.0
        self.dropped_groups = 0
        return out

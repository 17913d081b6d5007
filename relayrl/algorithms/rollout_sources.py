"""Where a data-plane step's rollout comes from when it is generated for the step: `ActorSource`.

A data-plane trainer (`GRPOSyncSteps`, `PPOSyncSteps`) runs the same phases whatever made its rows; it takes them from
a `protocols.RolloutSource`. Three exist: `ActorSource` here (the synchronous trainers: the run's rollout actor
generates each batch when the step asks for it), `producer_source.ProducerSource` (asynchronous GRPO: the producer
made the batch ahead, under the staleness bound) and `replay.RecordedSource` (`relayrl replay`: a flight recording's
rows). The pieces a generated and a recorded batch share live here too: the phases before the rollout
(`prepare_rollout`) and the carry as the driver receives it (`received`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from relayrl.algorithms.protocols import Generation, Rollout, RolloutActor
from relayrl.algorithms.trainer_common import KvScaleSync, split_rollout_timings
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.carry_wire import decode_carry, wire_nbytes
from relayrl.experience.flight_recorder import RecordRequest
from relayrl.utils.timer import Timer

__all__ = ["ActorSource", "RolloutSpec", "StepStart", "prepare_rollout", "received"]

#: Called once per step before its first rows reach the store, with the rollout side's store counters (just reset:
#: validation traffic is not the step's): starts the trainer's own byte counters and prepares the step's partition.
StepStart = Callable[[dict[str, float]], None]


@dataclass(frozen=True)
class RolloutSpec:
    """What a trainer asks of every rollout: where its rows go and which per-row values come back to the driver."""

    partition_id: str
    group_size: int  # rows per prompt, contiguous
    carry_keys: list[str]
    text_rows: int | None  # rows whose text crosses to the driver (the samples logged), None for all


def prepare_rollout(
    batch: BatchedDataDict, group_size: int, timer: Timer, kv_sync: KvScaleSync, generation: Generation
) -> BatchedDataDict:
    """The phases before a rollout, each under its timer: repeat each prompt `group_size` times (the actor flattens
    prompts into group ids), FP8 KV calibration before the first refit, waking the engine (the refit). Returns the repeated batch."""
    with timer.time("data_processing"):
        repeated = batch.repeat_interleave(group_size)
    kv_sync.before_first_refit(repeated)
    with timer.time("refit"):  # the engine syncs to the policy's weights here
        generation.prepare_for_generation()
    return repeated


def received(
    meta: KVBatchMeta, wire_carry: Mapping[str, Any], metrics: dict[str, Any], reference_in_store: bool = False
) -> Rollout:
    """A rollout as the driver received it: the carry decoded (values and dtypes as the legacy trainer's), its size
    the bytes of its wire form (the smallest exact encoding: what crossed)."""
    return Rollout(meta, decode_carry(wire_carry), metrics, wire_nbytes(wire_carry), reference_in_store)


class ActorSource:
    """The synchronous trainers' source: one rollout-actor call generates, scores and writes each batch on the spot.

    The actor (shared with validation, which rolls out through it between steps) is this source's: `close` shuts it
    down."""

    def __init__(
        self,
        actor: RolloutActor,
        generation: Generation,
        kv_sync: KvScaleSync,
        timer: Timer,
        spec: RolloutSpec,
        start_step: StepStart,
    ) -> None:
        self.actor, self.generation, self.kv_sync, self.timer = actor, generation, kv_sync, timer
        self.spec, self.start_step = spec, start_step

    def next(self, batch: BatchedDataDict, step: int, *, first_batch: bool, step_starts: bool) -> Rollout:
        spec = self.spec
        repeated = prepare_rollout(batch, spec.group_size, self.timer, self.kv_sync, self.generation)
        if step_starts:
            with self.timer.time("data_plane"):  # the step's counters start over, its partition is prepared
                self.start_step(self.actor.data_plane_metrics(reset=True))
        with self.timer.time("generation"):
            meta, wire_carry, metrics = self.actor.rollout_to_tq(
                repeated,
                partition_id=spec.partition_id,
                group_size=spec.group_size,
                first_iter=first_batch,
                carry_keys=spec.carry_keys,
                text_rows=spec.text_rows,
            )
        split_rollout_timings(self.timer, "generation", metrics)  # the environment's and the store's seconds
        with self.timer.time("data_processing"):
            return received(meta, wire_carry, metrics)

    def record(self, meta: KVBatchMeta, request: RecordRequest) -> None:
        """The actor that rolled the step out holds its rows; it joins them with the store's columns."""
        self.actor.record_step(meta, request)

    def store_metrics(self) -> dict[str, float]:
        return self.actor.data_plane_metrics(reset=True)

    def after_step(self, step: int) -> dict[str, float]:
        return {}

    def validating(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        self.actor.shutdown()

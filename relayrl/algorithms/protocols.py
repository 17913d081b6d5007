"""The seams a trainer sees: small Protocols for what the step code calls, nothing more.

A trainer names these instead of the concrete classes in `relayrl.models` and `relayrl.experience`, so a reader (and
mypy) can follow every call from a trainer phase into the component that serves it, and a test can pass any object
that has the methods. The legacy trainers use `Policy` / `Value`; the data-plane trainers use `DataPlanePolicy` /
`DataPlaneValue`, whose passes read and write the store by key instead of taking tensors. `setup` builds a
`BuiltPolicy` / `BuiltDataPlanePolicy`: the trainer's Protocol plus what the set-up itself calls (resume, generation).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

from relayrl.algorithms.interfaces import LossFunction
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface
from relayrl.experience.flight_recorder import RecordRequest
from relayrl.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec, RefitSource
from relayrl.utils.timer import Timer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "BatchLoader",
    "BuiltDataPlanePolicy",
    "BuiltPolicy",
    "Checkpointable",
    "Checkpointer",
    "ColocatedWeights",
    "DataPlanePolicy",
    "DataPlaneValue",
    "Generation",
    "KvCalibrator",
    "Policy",
    "Resumable",
    "Rollout",
    "RolloutActor",
    "RolloutSource",
    "Tokenizer",
    "TrainLogger",
    "Value",
]


#: The run's Hugging Face tokenizer (any fast or slow tokenizer with a chat template).
Tokenizer: TypeAlias = "PreTrainedTokenizerBase"


class BatchLoader(Protocol):
    """The train or validation loader: batches of prompts, a length, and (train) a resumable position."""

    def __iter__(self) -> Iterator[BatchedDataDict]: ...
    def __len__(self) -> int: ...
    def state_dict(self) -> dict[str, object]: ...


class Generation(Protocol):
    """The generation engine as a trainer drives it: wake, sample (through `experience`), sleep, checkpoint RNG."""

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]: ...
    def prepare_for_generation(self) -> bool: ...
    def finish_generation(self) -> bool: ...
    def get_rng_state(self) -> torch.Tensor: ...
    def set_rng_state(self, state: torch.Tensor) -> None: ...
    def shutdown(self) -> bool: ...
    def set_kv_scales(self, kv_scales: Mapping[str, float] | None) -> None: ...
    @property
    def kv_scales(self) -> dict[str, float] | None: ...


class Checkpointable(Protocol):
    """Whatever writes its weights (and optimizer, tokenizer) into a checkpoint: the policy, or policy and critic."""

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None: ...


class KvCalibrator(Protocol):
    """A policy that measures its attention inputs for an FP8 KV cache (`fp8_kv`)."""

    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]: ...


class Policy(Checkpointable, KvCalibrator, Protocol):
    """The policy of the legacy trainers: every pass takes and returns driver-side tensors."""

    def prepare_for_lp_inference(self) -> None: ...
    def get_logprobs(self, data: BatchedDataDict, timer: Timer | None = None) -> BatchedDataDict: ...
    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict: ...
    def prepare_for_training(self) -> None: ...
    def train(self, data: BatchedDataDict, loss_fn: LossFunction) -> dict[str, Any]: ...
    def finish_training(self) -> None: ...
    def shutdown(self) -> bool: ...


class DataPlanePolicy(Checkpointable, KvCalibrator, Protocol):
    """The policy of the data-plane trainers: passes take a `KVBatchMeta`; workers fetch and write back by key."""

    tq_partition_id: str
    dp_client: DataPlaneClient

    def prepare_step(self, num_samples: int, group_size: int | None = None) -> None: ...
    def prepare_val_partition(self, num_samples: int, *, partition_id: str = "val") -> None: ...
    def discard_samples(self, sample_ids: list[str], partition_id: str) -> None: ...
    def finish_step(self, meta: KVBatchMeta) -> None: ...
    def read_from_dataplane(self, meta: KVBatchMeta, *, select_fields: Sequence[str]) -> BatchedDataDict: ...
    def write_to_dataplane(self, meta: KVBatchMeta, fields: Mapping[str, torch.Tensor]) -> None: ...
    def prepare_for_lp_inference(self) -> None: ...
    def get_logprobs_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> None: ...
    def get_reference_policy_logprobs_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> None: ...
    def seq_logprob_error_from_meta(self, meta: KVBatchMeta, timer: Timer | None = None) -> BatchedDataDict: ...
    def prepare_for_training(self) -> None: ...
    def train_from_meta(
        self, meta: KVBatchMeta, loss_fn: LossFunction, *, timer: Timer | None = None, train_fields: Sequence[str] = ...
    ) -> dict[str, Any]: ...
    def finish_training(self) -> None: ...
    def data_plane_metrics(
        self, reset: bool = False, *, extra: Sequence[Mapping[str, float]] = ()
    ) -> dict[str, float]: ...
    def shutdown(self) -> bool: ...


class Resumable(Protocol):
    """A policy `setup` resumes before any trainer runs: the live weights (and optimizer) from a checkpoint."""

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None: ...


class ColocatedWeights(RefitSource, Protocol):
    """What `setup` reads from the policy to build a generation engine: in-process over its live weights (local
    executor): rank 0's model (`Any`: a torch module, or its LoRA-merged view), the device it runs on, and the digests
    refit verification compares the engine's weights with (`policy.generation.refit_verify`); on Ray generation
    workers refitted from it (`RefitSource`)."""

    @property
    def generation_source(self) -> Any: ...
    @property
    def device(self) -> torch.device: ...
    def refit_digests(self, keys: list[str]) -> dict[str, tuple[str, int, int]]: ...
    def generation_storage(self) -> set[int]: ...


class BuiltPolicy(Policy, Resumable, ColocatedWeights, Protocol):
    """The legacy policy as `setup` builds it: what the legacy trainers call, plus the set-up's own calls."""


class BuiltDataPlanePolicy(DataPlanePolicy, Resumable, ColocatedWeights, Protocol):
    """The data-plane policy as `setup` builds it: what the data-plane trainers call, plus the set-up's own calls."""


class Value(Checkpointable, Protocol):
    """The critic of the legacy PPO trainer."""

    def prepare_for_inference(self) -> None: ...
    def get_values(self, data: BatchedDataDict, timer: Timer | None = None) -> BatchedDataDict: ...
    def finish_inference(self) -> None: ...
    def prepare_for_training(self) -> None: ...
    def train(self, data: BatchedDataDict, loss_fn: LossFunction) -> dict[str, Any]: ...
    def finish_training(self) -> None: ...
    def shutdown(self) -> bool: ...


class DataPlaneValue(Checkpointable, Protocol):
    """The critic of the data-plane PPO trainer: values, GAE and updates run on its workers, by key."""

    tq_partition_id: str
    dp_client: DataPlaneClient

    def prepare_step(self, num_samples: int) -> None: ...
    def finish_step(self, meta: KVBatchMeta) -> None: ...
    def write_to_dataplane(self, meta: KVBatchMeta, fields: Mapping[str, torch.Tensor]) -> None: ...
    def prepare_for_inference(self) -> None: ...
    def get_values_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> None: ...
    def finish_inference(self) -> None: ...
    def compute_advantages_from_meta(
        self, meta: KVBatchMeta, estimator: Any, *, logprob_fields: Sequence[str] = (), timer: Timer | None = None
    ) -> dict[str, float]: ...
    def prepare_for_training(self) -> None: ...
    def train_from_meta(
        self, meta: KVBatchMeta, loss_fn: LossFunction, *, timer: Timer | None = None
    ) -> dict[str, Any]: ...
    def finish_training(self) -> None: ...
    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]: ...
    def shutdown(self) -> bool: ...


class RolloutActor(Protocol):
    """Rolls a batch out, scores it and writes its bulk into the store; returns the handle, a small per-row carry in
    its wire form (`carry_wire.decode_carry` gives the values) and the rollout metrics."""

    def rollout_to_tq(
        self,
        input_batch: BatchedDataDict,
        *,
        partition_id: str,
        group_size: int = ...,
        first_iter: bool = ...,
        finish_generation: bool = ...,
        task_to_env_override: dict[str, EnvironmentInterface] | None = ...,
        carry_keys: Sequence[str] | None = ...,
        greedy: bool = ...,
        text_rows: int | None = ...,
        row_tags: Mapping[str, Any] | None = ...,
    ) -> tuple[KVBatchMeta, dict[str, Any], dict[str, float]]: ...
    def record_step(self, meta: KVBatchMeta, request: RecordRequest, rows_from: Any = None) -> str: ...
    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]: ...
    def shutdown(self) -> bool: ...


# ---------------------------------------------------------------------------------------------- rollout sources
@dataclass
class Rollout:
    """One generation batch of a step, written to the store: what a data-plane step's phases start from."""

    meta: KVBatchMeta  # the rows' keys, lengths and tags
    carry: BatchedDataDict  # per-row values on the driver (rewards, lengths, group ids, ...), each [B]
    metrics: dict[str, float]  # the rollout's own metrics (generated tokens, turns, ...)
    carry_bytes: int  # what crossed to the driver for the carry: its wire form's size
    reference_in_store: bool = False  # the reference log-probs are written already (the async producer's pass)


class RolloutSource(Protocol):
    """Where a data-plane trainer's rollouts come from: generated for the step (`rollout_sources.ActorSource`),
    made ahead by the asynchronous producer (`producer_source.ProducerSource`) or read from a flight recording
    (`replay.RecordedSource`). The step's phases are the same for each; what a source needs around them (publishing
    weights, retiring partitions, its own metrics) goes through these hooks, so no trainer subclasses another."""

    def next(self, batch: BatchedDataDict, step: int, *, first_batch: bool, step_starts: bool) -> Rollout:
        """The rows of `step` for `batch`'s prompts, in the store. `first_batch`: the step's first generation batch;
        `step_starts`: none of the step's rows is in the store yet (dynamic sampling may use several batches)."""
        ...

    def record(self, meta: KVBatchMeta, request: RecordRequest) -> None:
        """Write the flight recorder's file of the step (its keys still in the store)."""
        ...

    def store_metrics(self) -> dict[str, float]:
        """The rollout side's store counters for the step (it wrote the bulk); read once, at the step's end."""
        ...

    def after_step(self, step: int) -> dict[str, float]:
        """After the step's keys left the store: the source's own `train/*` metrics (async: the samples' age)."""
        ...

    def validating(self) -> AbstractContextManager[None]:
        """Held around a validation (the async producer on Ray lends its workers to it between batches)."""
        ...

    def close(self) -> None: ...


class TrainLogger(Protocol):
    """Where a step's metrics and sample rows go."""

    def log_metrics(self, metrics: dict[str, Any], step: int, prefix: str = "") -> None: ...
    def log_jsonl(self, rows: list[dict[str, Any]], filename: str) -> Path: ...
    def print_message(self, message: str) -> None: ...


class Checkpointer(Protocol):
    """Writes a checkpoint atomically: a temporary directory first, then the rename that makes it visible."""

    def init_tmp_checkpoint(
        self, step: int, training_info: dict[str, Any], run_config: dict[str, Any] | None = None
    ) -> Path: ...
    def finalize_checkpoint(self, tmp_path: str | Path) -> Path: ...

"""Generation-backend contract: prompts in (right-padded token ids), sampled continuations out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict

import torch

if TYPE_CHECKING:
    from relayrl.distributed.batched_data_dict import BatchedDataDict
    from relayrl.distributed.interfaces import WorkerGroup


class GenerationDatumSpec(TypedDict):
    """One generation request batch (right-padded with the pad id)."""

    input_ids: torch.Tensor  # [B, S] int64
    input_lengths: torch.Tensor  # [B] int64, real tokens per row
    stop_strings: NotRequired[list[list[str] | None]]  # per-row extra stop strings


class GenerationOutputSpec(TypedDict):
    """Generation result, per row: prompt tokens, then generated tokens immediately after them, then pad."""

    output_ids: torch.Tensor  # [B, S_in + max_new_tokens] int64
    logprobs: torch.Tensor  # [B, S_in + max_new_tokens] float32, log-prob of each sampled token; 0 elsewhere
    generation_lengths: torch.Tensor  # [B] int64, generated tokens (stop token included when produced)
    unpadded_sequence_lengths: torch.Tensor  # [B] int64, input_lengths + generation_lengths
    truncated: torch.Tensor  # [B] bool, stopped by max_new_tokens (or the context limit), not by a stop condition
    support: NotRequired[torch.Tensor]  # [B, S_in + max_new_tokens, K] int32, the sampler's top-k/top-p kept set
    # of each generated token (`sampling.support_record`), zeros elsewhere; only when sampling filters


class GenerationInterface(ABC):
    """A generation engine. The trainer wakes it, samples, and puts it to sleep around training."""

    @abstractmethod
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Sample continuations for every row of `data`."""

    @abstractmethod
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Idempotent wake-up before a rollout."""

    @abstractmethod
    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Release generation-only state (KV caches) after a rollout."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Idempotent shutdown."""

    @property
    def requires_kv_scale_sync(self) -> bool:
        """True iff the engine keeps an FP8 KV cache whose scales must follow the policy."""
        return False

    # Refit receiver side. Colocated local engines read the policy's weights directly and need none of these;
    # separate generation workers implement them.
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} does not join weight-update collectives")

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not receive refits")

    def update_weights_via_ipc_zmq(self) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} does not receive refits over ZMQ IPC")

    def update_weights_from_collective(self) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} does not receive refits over a collective")


class RefitSource(Protocol):
    """The policy a `DistributedGeneration` follows: its ranks (how many, on which nodes), its weights version, and
    the calls that hand its weights to the generation workers (each returns one waitable handle per rank)."""

    @property
    def dp_size(self) -> int: ...
    @property
    def worker_group(self) -> WorkerGroup[Any]: ...
    @property
    def weights_version(self) -> int: ...
    def prepare_refit_info(self) -> dict[str, Any] | None: ...
    def refit_digests(self, keys: list[str]) -> dict[str, tuple[str, int, int]]: ...
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]: ...
    def offload_before_refit(self) -> None: ...
    def offload_after_refit(self) -> None: ...
    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int, kv_scales: dict[str, float] | None = None
    ) -> list[Any]: ...
    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> list[Any]: ...

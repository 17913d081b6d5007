"""Policy contracts of the seeds: what a trainer may ask of a policy, whatever executes it.

Names, argument names and defaults follow the specification page for `policy.interfaces` exactly, so code written
against the reference interfaces ports over unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:
    from relayrl.algorithms.interfaces import LossFunction
    from relayrl.distributed.batched_data_dict import BatchedDataDict
    from relayrl.models.generation.interfaces import GenerationDatumSpec


class LogprobOutputSpec(TypedDict):
    """logprobs: Tensor of log probabilities."""

    logprobs: torch.Tensor  # [B, S] float32, token-aligned: entry t = log p(x_t | x_<t); 0 at t=0 and on padding


class ReferenceLogprobOutputSpec(TypedDict):
    """logprobs: Tensor of log probabilities."""

    reference_logprobs: torch.Tensor  # [B, S] float32, same alignment as LogprobOutputSpec.logprobs


class ScoreOutputSpec(TypedDict):
    """scores: Tensor of scores."""

    scores: torch.Tensor  # [B]


class TopkLogitsOutputSpec(TypedDict):
    """Per-position top-k logits and corresponding global token indices."""

    topk_logits: torch.Tensor  # [B, S-1, k] float32
    topk_indices: torch.Tensor  # [B, S-1, k] int64, global vocabulary ids


class PolicyInterface(ABC):
    """Abstract base class defining the interface for RL policies."""

    @abstractmethod
    def get_logprobs(self, data: BatchedDataDict[GenerationDatumSpec]) -> BatchedDataDict[LogprobOutputSpec]:
        """Get logprobs of actions from observations.

        Args:
            data: BatchedDataDict containing rollouts (tokens).

        Returns:
            BatchedDataDict containing `logprobs`: tensor of logprobs of actions.
        """

    @abstractmethod
    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[GenerationDatumSpec], micro_batch_size: int | None = None
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]:
        """Get logprobs of actions from observations under the frozen reference policy."""

    @abstractmethod
    def get_topk_logits(
        self, data: BatchedDataDict[GenerationDatumSpec], k: int, micro_batch_size: int | None = None
    ) -> BatchedDataDict[TopkLogitsOutputSpec]:
        """Get per-position top-k logits and global indices for a batch of inputs.

        Aligns to next-token positions: returns S-1 positions.
        """

    @abstractmethod
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Train the policy on a global batch of data.

        Args:
            data: BatchedDataDict containing rollouts (tokens).
            loss_fn: Loss function to use for training.
            eval_mode: Whether to run in evaluation mode (no gradient updates).
            gbs: Global batch size override (if None, uses config default).
            mbs: Micro batch size override (if None, uses config default).
        """

    @abstractmethod
    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]:
        """Calibrate FP8 scales for Q/K/V activations used by the KV cache.

        Args:
            data: BatchedDataDict containing input_ids and input_lengths.
            micro_batch_size: Optional override for micro batch size during calibration.
            percentile: Percentile for per-tensor amax estimation.
            margin: Safety margin multiplier applied to amax.
            include_q: Whether to also compute scale for Q in addition to K/V.

        Returns:
            Dict with overall configuration and per-layer scales.
        """

    @abstractmethod
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def finish_training(self, *args: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def shutdown(self) -> bool: ...


class ColocatablePolicyInterface(PolicyInterface):
    """A policy that can share devices with a generation engine and hand it fresh weights (refit)."""

    @abstractmethod
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        """Join a weight-update process group spanning training rank 0 and every generation worker."""

    @abstractmethod
    def offload_before_refit(self) -> None:
        """Move optimizer state and gradients off the device before weights are streamed."""

    @abstractmethod
    def offload_after_refit(self) -> None:
        """Move training weights off the device once generation holds them."""

    @abstractmethod
    def prepare_refit_info(self) -> dict[str, Any] | None:
        """Describe the streamed tensors: {name: (shape, dtype)}."""

    @abstractmethod
    def stream_weights_via_ipc_zmq(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Stream weights to a colocated generation worker in size-bounded buckets over ZMQ IPC."""

    @abstractmethod
    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> list[Any]:
        """Broadcast weights (and FP8 KV scales when given) to non-colocated generation workers."""

    @abstractmethod
    def prepare_for_lp_inference(self) -> None:
        """Put the model in inference mode for logprob passes."""

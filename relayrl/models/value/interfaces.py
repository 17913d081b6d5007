"""Value-model contract of the seeds (the PPO critic)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:
    from relayrl.algorithms.interfaces import LossFunction
    from relayrl.distributed.batched_data_dict import BatchedDataDict
    from relayrl.models.generation.interfaces import GenerationDatumSpec
    from relayrl.utils.timer import Timer


class ValueOutputSpec(TypedDict):
    """values: Tensor of value predictions [batch_size, sequence_length]."""

    values: torch.Tensor  # [B, S] float32, V[:, t] = value of the state before token t; 0 on padding


class ValueInterface(ABC):
    """Abstract base class defining the interface for value functions."""

    @abstractmethod
    def get_values(
        self, data: BatchedDataDict[GenerationDatumSpec], timer: Timer | None = None
    ) -> BatchedDataDict[ValueOutputSpec]:
        """Get value predictions for observations."""

    @abstractmethod
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Timer | None = None,
    ) -> dict[str, Any]:
        """Train the value function on a global batch of data; returns loss, grad_norm and value metrics."""

    @abstractmethod
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Prepare the value model for training (e.g. load to the device)."""

    @abstractmethod
    def prepare_for_inference(self, *args: Any, **kwargs: Any) -> None:
        """Prepare the value model for inference (e.g. offload gradients)."""

    @abstractmethod
    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """Clean up after training."""

    @abstractmethod
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Save model checkpoint."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Shutdown workers and clean up resources."""

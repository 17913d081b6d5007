"""Loss-function contract shared by the policy and value trainers."""

from __future__ import annotations

import enum
from typing import Any, Protocol

import torch


class LossType(enum.Enum):
    """How a loss is aggregated: over every valid token of the global batch, or per sequence then over sequences."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class MetricNormalizer(enum.Enum):
    """What a per-micro-batch metric was divided by, so partial sums add up to the global-batch value."""

    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


class LossFunction(Protocol):
    """A loss over one micro-batch whose value is a *partial sum* of the global-batch mean.

    The caller passes the global counts (valid sequences and tokens of the whole global batch, across micro-batches
    and DP ranks) so that summing micro-batch losses gives exactly the full-batch loss, whatever the split.
    """

    loss_type: LossType

    def __call__(
        self,
        model_output: torch.Tensor,  # policy: next-token logprobs [B, S-1] with grad; value: values [B, S]
        data: dict[str, Any],  # token-aligned [B, S] tensors + sample_mask [B]
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        /,
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...

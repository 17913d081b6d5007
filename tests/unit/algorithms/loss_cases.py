"""Shared cases for the ClippedPGLossFn tests: B=1, S=4, token_mask [0,1,1,1]; values are for the 3 loss positions.
With prev = [-1,-1,-1], curr = [ln .5 - 1, -1, ln 1.5 - 1] gives ratios [0.5, 1, 1.5]; A = [1, -1, 2]."""

from __future__ import annotations

import math
from typing import Any

import torch

from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.config import ClippedPGLossConfig

T = torch.tensor
CURR = [math.log(0.5) - 1, -1.0, math.log(1.5) - 1]  # ~[-1.69315, -1.0, -0.59453]
PREV = [-1.0, -1.0, -1.0]
ADV = [1.0, -1.0, 2.0]


def cfg(**kw: Any) -> ClippedPGLossConfig:
    return ClippedPGLossConfig(**{"reference_policy_kl_penalty": 0.0, **kw})


def make_data(
    adv: list,
    prev: list,
    gen: list | None = None,
    ref: list | None = None,
    token_mask: list | None = None,
    sample_mask: list | None = None,
) -> dict[str, torch.Tensor]:
    """Token-aligned [B, S] tensors from per-loss-position rows (a leading 0 column is added)."""

    def aligned(rows: list) -> torch.Tensor:
        t = T(rows if isinstance(rows[0], list) else [rows], dtype=torch.float32)
        return torch.cat([torch.zeros(t.shape[0], 1), t], dim=1)

    prev_t = aligned(prev)
    b, s = prev_t.shape
    tm = aligned(token_mask) if token_mask is not None else torch.cat([torch.zeros(b, 1), torch.ones(b, s - 1)], 1)
    return {
        "token_mask": tm,
        "sample_mask": T(sample_mask if sample_mask is not None else [1.0] * b),
        "advantages": aligned(adv),
        "prev_logprobs": prev_t,
        "generation_logprobs": aligned(gen) if gen is not None else prev_t.clone(),
        "reference_policy_logprobs": aligned(ref) if ref is not None else prev_t.clone(),
    }


def counts(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    sm = data["sample_mask"]
    return sm.sum(), (data["token_mask"][:, 1:] * sm.unsqueeze(-1)).sum()


def run(loss_fn: Any, curr: list, data: dict[str, torch.Tensor], grad: bool = False):
    c = T(curr if isinstance(curr[0], list) else [curr], requires_grad=grad)
    loss, metrics = loss_fn(c, data, *counts(data))
    return (loss, metrics, c) if grad else (loss, metrics)


def seq_mask_tis_loss() -> ClippedPGLossFn:
    return ClippedPGLossFn(
        cfg(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio=1.002,
            truncated_importance_sampling_ratio_min=0.999,
        )
    )


def gspo_loss(**kw: Any) -> ClippedPGLossFn:
    return ClippedPGLossFn(cfg(sequence_level_importance_ratios=True, token_level_loss=False, **kw))

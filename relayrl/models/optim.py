"""Optimizer-step mechanics shared by the policy and value workers (one place for the DP gradient all-reduce)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from relayrl.distributed.interfaces import Collective


def all_reduce_clip_and_step(
    params: list[nn.Parameter], comm: Collective, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
) -> torch.Tensor:
    """Sum gradients over data-parallel ranks, clip to `max_grad_norm`, take one optimizer step.

    Losses are partial sums of the global-batch mean on every rank, so *summing* gradients (not averaging) gives the
    gradient of the global mean. Returns the pre-clip global L2 norm (CPU scalar).
    """
    if comm.world_size > 1:
        for p in params:  # every rank must contribute a buffer of the same layout
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # [P] one collective instead of one per tensor
        comm.all_reduce_sum(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    max_norm = max_grad_norm if max_grad_norm is not None else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach().cpu()
    optimizer.step()
    return grad_norm


def record_microbatch_metrics(
    metrics: dict[str, list[float]],
    mb_metrics: dict[str, Any],
    num_global_batches: int,
    lr: float,
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
) -> None:
    """Append one micro-batch's loss metrics: normalised ones divided by the number of global batches (so the
    driver's sum is the mean over global batches), extrema (`_min`/`_max`) as they are, plus lr and global counts."""
    for key, value in mb_metrics.items():
        value = float(value)
        metrics[key].append(value if ("_min" in key or "_max" in key) else value / num_global_batches)
    metrics["lr"].append(lr)
    metrics["global_valid_seqs"].append(float(global_valid_seqs))
    metrics["global_valid_toks"].append(float(global_valid_toks))

"""The optimizer step the model-building scripts share (make_tiny_model.py, make_reward_model.py)."""

from __future__ import annotations

import torch


def warmup_step(model: torch.nn.Module, optim: torch.optim.Optimizer, loss: torch.Tensor, step: int, args) -> None:
    """One optimizer step on `loss` at step `step` (from 0): learning rate `args.lr` after a linear warm-up over
    `args.warmup_steps` steps, gradients clipped to norm 1."""
    for group in optim.param_groups:
        group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup_steps)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()

"""The optimizer step the model-building scripts share (make_tiny_model.py, make_reward_model.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from relayrl.experience import arithmetic


def warmup_step(model: torch.nn.Module, optim: torch.optim.Optimizer, loss: torch.Tensor, step: int, args) -> None:
    """One optimizer step on `loss` at step `step` (from 0): learning rate `args.lr` after a linear warm-up over
    `args.warmup_steps` steps, gradients clipped to norm 1."""
    for group in optim.param_groups:
        group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup_steps)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()


def warm_start_parser(
    description: str, out: str, *, max_steps: int, eval_every: int, target_high: float
) -> argparse.ArgumentParser:
    """The options both warm-start scripts share (output, seed, optimiser, stopping band, task range, threads);
    each passes the defaults that differ and adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=max_steps)
    p.add_argument("--eval-every", type=int, default=eval_every)
    p.add_argument("--target-low", type=float, default=0.30)
    p.add_argument("--target-high", type=float, default=target_high)
    p.add_argument("--num-val", type=int, default=arithmetic.DEFAULT_NUM_VAL)
    p.add_argument("--min-operand", type=int, default=10)
    p.add_argument("--max-operand", type=int, default=99)
    # One thread: on a shared, oversubscribed CPU two intra-op threads measured ~15x slower per step, not faster.
    p.add_argument("--threads", type=int, default=1)
    return p

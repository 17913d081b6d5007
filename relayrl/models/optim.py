"""Optimizer-step mechanics shared by the policy and value workers (one place for the DP gradient all-reduce)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relayrl.distributed.interfaces import Collective
from relayrl.distributed.parallelize import DataParallel
from relayrl.models.microbatch import ShardPlan, cut, with_replays
from relayrl.utils import device as dev


def all_reduce_clip_and_step(
    params: list[nn.Parameter],
    comm: Collective,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    dp: DataParallel | None = None,
) -> torch.Tensor:
    """Sum gradients over data-parallel ranks, clip to `max_grad_norm`, take one optimizer step.

    Losses are partial sums of the global-batch mean on every rank, so *summing* gradients (not averaging) gives the
    gradient of the global mean. Under DDP / FSDP2 (`dp`) backward already summed them; FSDP2's norm is taken over
    the shards. Returns the pre-clip global L2 norm (CPU scalar); when it is not finite no step is taken.
    """
    max_norm = max_grad_norm if max_grad_norm is not None else float("inf")
    if dp is not None and dp.reduces_in_backward:
        grad_norm = dp.global_grad_norm_and_clip(max_norm)
        if _finite(grad_norm):
            optimizer.step()
        dp.after_step()
        return grad_norm
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
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach().cpu()
    if _finite(grad_norm):
        optimizer.step()
    return grad_norm


def _finite(grad_norm: torch.Tensor) -> bool:
    """A NaN or infinite global gradient norm (the same on every rank) skips the step: the weights and the Adam
    moments stay as they were, and the trainer, seeing the norm, stops the run before anything is checkpointed."""
    return bool(torch.isfinite(grad_norm).all())


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


def train_global_batches(
    *,
    data: Any,  # BatchedDataDict of this rank's rows
    gbs: int,
    mbs: int,
    eval_mode: bool,
    comm: Collective,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    params: list[nn.Parameter],
    device: torch.device,
    micro_batches: Callable[[Any, int, torch.device], Any],
    valid_tokens: Callable[[Any], torch.Tensor],
    loss_for_microbatch: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
    step: Callable[[list[nn.Parameter]], torch.Tensor],
    rank: int,
    dp: DataParallel | None = None,
    zero_loss: Callable[[Any], torch.Tensor] | None = None,
    plan: ShardPlan | None = None,
) -> dict[str, Any]:
    """One train() call (reference §3.9), shared by the policy and value workers.

    One optimizer step per global batch of `gbs` rows (gbs / world on this rank); counts of valid sequences and
    tokens are summed over ranks, so every micro-batch loss is a partial sum of the global-batch mean; the scheduler
    steps once per call. `valid_tokens(gb_data)` is the token mask the loss averages over (the policy's drops
    position 0). Callers own train/eval mode and the no-grad context.

    `dp` (DDP / FSDP2) reduces gradients inside backward, so every rank runs every micro-batch and only the last
    micro-batch of a global batch syncs. One without a valid sample or without any loss position runs
    `zero_loss(mb)` instead of the loss: a full forward touching every parameter, times 0 (exactly zero gradients,
    the same collectives as its peers whatever the loss function skips), and is not recorded.

    `plan` (sequence packing / dynamic batching): this rank's rows per global batch and its micro-batches come from
    the plan instead of `gbs` / `mbs`; under `dp` every rank tops its micro-batches up to the largest count of any
    rank with zero-loss replays (`microbatch.with_replays`).
    """
    world = comm.world_size
    wrapped = dp is not None and dp.reduces_in_backward
    if wrapped and zero_loss is None:
        raise ValueError("train_global_batches: a DDP/FSDP2 strategy needs zero_loss for dummy micro-batches")
    if plan is None:
        local_gbs = gbs // world
        if local_gbs < 1 or local_gbs % mbs:
            raise ValueError(f"per-rank global batch {gbs}/{world}={local_gbs} is not a multiple of mbs={mbs}")
        if data.size % local_gbs:
            raise ValueError(f"{data.size} rows on rank {rank} are not a multiple of the per-rank batch {local_gbs}")
        gb_bounds = [(gb * local_gbs, (gb + 1) * local_gbs) for gb in range(data.size // local_gbs)]
    else:
        gb_bounds = plan.gb_bounds()
        if (gb_bounds[-1][1] if gb_bounds else 0) != data.size:
            raise ValueError(
                f"the micro-batch plan covers {sum(plan.elem_counts_per_gb)} rows, rank {rank} has {data.size}"
            )
    num_gb = len(gb_bounds)
    lr = optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0
    losses: list[torch.Tensor] = []
    grad_norm: torch.Tensor | None = None
    metrics: dict[str, list[float]] = defaultdict(list)
    total_seqs, total_toks = 0.0, 0.0
    for gb, (gb_start, gb_end) in enumerate(gb_bounds):
        gb_data = data.slice(gb_start, gb_end)
        sample_mask = gb_data["sample_mask"].float()  # [b]
        counts = torch.stack([sample_mask.sum(), (valid_tokens(gb_data).float() * sample_mask[:, None]).sum()]).to(
            device
        )  # [2]: valid sequences, valid tokens of this rank's part
        comm.all_reduce_sum(counts)
        global_seqs, global_toks = counts[0], counts[1]
        total_seqs += float(global_seqs)
        total_toks += float(global_toks)
        if not eval_mode and optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        gb_loss = torch.zeros((), device=device)
        if plan is None:
            num_mb = -(-gb_data.size // mbs)
            batches = ((mb, False) for mb in micro_batches(gb_data, mbs, device))
        else:
            planned = plan.micro_batches(gb)
            if wrapped:  # every rank must run as many forward/backward passes as the busiest one
                planned = with_replays(planned, max(comm.all_gather_object(sum(m.end > m.start for m in planned))))
            planned = [m for m in planned if m.end > m.start]
            num_mb = len(planned)
            batches = ((cut(gb_data, m).to(device), m.replay) for m in planned)
        for i, (mb, replay) in enumerate(batches):
            valid = not replay and float(mb["sample_mask"].float().sum()) > 0
            if wrapped and valid:  # no loss position: a dummy too (an FSDP2 backward must pass through every unit)
                valid = float((valid_tokens(mb).float() * mb["sample_mask"].float()[:, None]).sum()) > 0
            if not valid and not wrapped:
                continue  # no valid sample: contributes nothing to the loss, metrics or gradient
            with dp.micro_batch(sync=i == num_mb - 1) if dp is not None else contextlib.nullcontext():

                def closure(
                    mb: Any = mb,
                    valid: bool = valid,
                    seqs: torch.Tensor = global_seqs,
                    toks: torch.Tensor = global_toks,
                ) -> tuple[torch.Tensor, dict[str, Any]]:
                    if valid:
                        loss, mb_metrics = loss_for_microbatch(mb, seqs, toks)
                        if dp is not None and wrapped and not eval_mode and not loss.requires_grad:
                            loss = loss + dp.zero_touch()  # no loss position (no graph): still reach the collectives
                        return loss, mb_metrics
                    assert zero_loss is not None
                    return zero_loss(mb), {}  # a dummy: every rank must reach the same collectives

                loss, mb_metrics = dp.forward(closure, training=not eval_mode) if dp is not None else closure()
                if not eval_mode and loss.requires_grad:  # no graph: no loss position, zero gradient
                    loss.backward()
            if valid:
                gb_loss += loss.detach()
                record_microbatch_metrics(metrics, mb_metrics, num_gb, lr, global_seqs, global_toks)
        if not eval_mode:
            grad_norm = step(params)
        losses.append(gb_loss)
    loss_per_gb = torch.stack(losses) if losses else torch.zeros(0, device=device)  # [num_gb]
    comm.all_reduce_sum(loss_per_gb)
    if not eval_mode and optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()  # once per train() call, not per optimizer step
    return {
        "loss": loss_per_gb.cpu(),
        "grad_norm": grad_norm,
        "all_mb_metrics": dict(metrics),
        "lr": lr,
        "num_global_batches": num_gb,
        "num_valid_seqs": total_seqs,
        "num_valid_tokens": total_toks,
    }


#: File name of the optimizer + scheduler state inside an optimizer checkpoint directory.
OPTIMIZER_FILE = "optimizer.pt"


def _require_optimizer(optimizer: torch.optim.Optimizer | None, scheduler: Any, owner: str) -> None:
    if optimizer is None or scheduler is None:
        raise ValueError(f"optimizer_path was given but the {owner} was built with init_optimizer=False")


def save_optimizer_checkpoint(
    path: str,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    weights_version: int,
    dp: DataParallel,
    rank: int,
    owner: str,
) -> None:
    """Write optimizer + scheduler state (whole tensors, whatever the strategy) to `path`/optimizer.pt from rank 0.

    Every rank must call it: under fsdp2 gathering the sharded moments is a collective. `owner` names the model in
    the error raised when it was built without an optimizer."""
    _require_optimizer(optimizer, scheduler, owner)
    assert optimizer is not None
    state = {
        "optimizer": dp.full_optimizer_state(optimizer),
        "scheduler": scheduler.state_dict(),
        "weights_version": weights_version,
    }
    if rank == 0:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(path) / OPTIMIZER_FILE)


def load_optimizer_checkpoint(
    path: str,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    dp: DataParallel,
    device: torch.device,
    owner: str,
) -> int:
    """Load what `save_optimizer_checkpoint` wrote (a directory or the file itself); returns the weights_version."""
    _require_optimizer(optimizer, scheduler, owner)
    assert optimizer is not None
    file = Path(path)
    if file.is_dir():
        file = file / OPTIMIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"optimizer checkpoint not found: {file}")
    state = torch.load(file, map_location="cpu", weights_only=True)
    dp.load_optimizer_state(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    dev.move_optimizer_state(optimizer, device)
    return int(state.get("weights_version", 0))

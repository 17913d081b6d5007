"""Optimizer-step mechanics shared by the policy and value workers (one place for the DP gradient all-reduce)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import Collective
from relayrl.distributed.parallelize import DataParallel
from relayrl.models.microbatch import ShardPlan, cut, with_replays
from relayrl.utils import device as dev

#: One micro-batch's loss: (micro-batch, global valid sequences, global valid tokens) -> (loss, metrics).
MicrobatchLoss: TypeAlias = Callable[[BatchedDataDict, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


def all_reduce_clip_and_step(
    params: list[nn.Parameter],
    comm: Collective,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    dp: DataParallel | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """Sum gradients over data-parallel ranks, clip to `max_grad_norm`, take one optimizer step.

    Losses are partial sums of the global-batch mean on every rank, so *summing* gradients (not averaging) gives the
    gradient of the global mean. Under DDP / FSDP2 (`dp`) backward already summed them; FSDP2's norm is taken over
    the shards. Returns the pre-clip global L2 norm (CPU scalar); when it is not finite no step is taken.

    `scaler` (float16): gradients are unscaled before the norm; an overflow (non-finite norm) skips the step and
    lowers the scale, as loss scaling expects, and the norm comes back as 0 with `scaler.overflowed` set.
    """
    max_norm = max_grad_norm if max_grad_norm is not None else float("inf")
    if dp is not None and dp.reduces_in_backward:
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = dp.global_grad_norm_and_clip(max_norm)
        if scaler is not None:
            grad_norm = _scaler_step(optimizer, grad_norm, scaler)
        elif _finite(grad_norm):
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
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach().cpu()
    if scaler is not None:
        return _scaler_step(optimizer, grad_norm, scaler)
    if _finite(grad_norm):
        optimizer.step()
    return grad_norm


def _scaler_step(
    optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, scaler: torch.amp.GradScaler
) -> torch.Tensor:
    """float16 loss scaling after unscale_ and clipping: step unless the gradients overflowed (every rank holds the
    same reduced gradients, so all agree), then grow or back off the scale. An overflow returns a norm of 0 and
    sets `scaler.overflowed` (the worker logs it): a skipped step is expected there, not a fault."""
    overflowed = not _finite(grad_norm)
    scaler.step(optimizer)  # skips the step when unscale_ found inf/NaN
    scaler.update()
    scaler.overflowed = overflowed  # type: ignore[attr-defined]
    return torch.zeros(()) if overflowed else grad_norm


def _finite(grad_norm: torch.Tensor) -> bool:
    """A NaN or infinite global gradient norm (the same on every rank) skips the step: the weights and the Adam
    moments stay as they were, and the trainer, seeing the norm, stops the run before anything is checkpointed."""
    return bool(torch.isfinite(grad_norm).all())


def record_microbatch_metrics(
    metrics: dict[str, list[float]],
    mb_metrics: dict[str, Any],
    num_global_batches: int,
    lr: float,
    global_valid_seqs: float | torch.Tensor,
    global_valid_toks: float | torch.Tensor,
) -> None:
    """Append one micro-batch's loss metrics: normalised ones divided by the number of global batches (so the
    driver's sum is the mean over global batches), extrema (`_min`/`_max`) as they are, plus lr and global counts."""
    for key, value in mb_metrics.items():
        value = float(value)
        metrics[key].append(value if ("_min" in key or "_max" in key) else value / num_global_batches)
    metrics["lr"].append(lr)
    metrics["global_valid_seqs"].append(float(global_valid_seqs))
    metrics["global_valid_toks"].append(float(global_valid_toks))


class TrainingReplica(Protocol):
    """The worker `train_global_batches` trains (`ModelWorker` is one): its collective, optimizer and data-parallel
    wrapper, plus the three model-specific steps the loop cannot know (what a loss averages over, how a rank with
    nothing to learn still joins its peers' collectives, the optimizer step itself) and how rows are batched."""

    @property
    def comm(self) -> Collective: ...
    @property
    def rank(self) -> int: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...
    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None: ...
    @property
    def dp(self) -> DataParallel: ...
    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """float16 loss scaling (None in float32 / bfloat16)."""
        ...

    def micro_batches(self, data: BatchedDataDict, size: int, device: torch.device) -> Iterator[BatchedDataDict]:
        """`data` in row blocks of `size`, each moved to `device`."""
        ...

    def valid_tokens(self, data: BatchedDataDict) -> torch.Tensor:
        """The token mask the loss averages over ([b, S] or [b, S-1])."""
        ...

    def zero_loss(self, mb: BatchedDataDict) -> torch.Tensor:
        """0 x a full forward of the training module (a dummy micro-batch under DDP / FSDP2)."""
        ...

    def step_optimizer(self) -> torch.Tensor:
        """Reduce gradients over ranks, clip, step; returns the pre-clip global L2 norm."""
        ...


@dataclass(frozen=True)
class TrainCall:
    """The shape of one train() call: `gbs` rows per optimizer step (gbs / world on this rank) in micro-batches of
    `mbs`, or the micro-batch `plan` (sequence packing / dynamic batching) instead; `device` is where the model
    computes."""

    gbs: int
    mbs: int
    eval_mode: bool
    device: torch.device
    plan: ShardPlan | None = None


@dataclass
class _Tally:
    """What a train() call accumulates over its global batches."""

    num_gb: int
    lr: float
    losses: list[torch.Tensor] = field(default_factory=list)  # one [] loss per global batch
    metrics: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    seqs: float = 0.0
    toks: float = 0.0
    grad_norm: torch.Tensor | None = None


def train_global_batches(
    replica: TrainingReplica, data: BatchedDataDict, loss: MicrobatchLoss, call: TrainCall
) -> dict[str, Any]:
    """One train() call, shared by the policy and value workers.

    One optimizer step per global batch; counts of valid sequences and tokens are summed over ranks, so every
    micro-batch `loss` is a partial sum of the global-batch mean; the scheduler steps once per call. Callers own
    train/eval mode and the no-grad context.

    A DDP / FSDP2 `replica.dp` reduces gradients inside backward, so every rank runs every micro-batch and only the
    last one of a global batch syncs. One without a valid sample or without any loss position runs
    `replica.zero_loss(mb)` instead of the loss: a full forward touching every parameter, times 0 (exactly zero
    gradients, the same collectives as its peers whatever the loss function skips), and is not recorded. Under a
    `call.plan` every such rank tops its micro-batches up to the busiest rank's count (`microbatch.with_replays`).
    """
    bounds = _global_batch_bounds(data.size, call, replica.comm.world_size, replica.rank)
    optimizer = replica.optimizer
    tally = _Tally(len(bounds), optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0)
    for gb, (gb_start, gb_end) in enumerate(bounds):
        _train_global_batch(replica, data.slice(gb_start, gb_end), gb, loss, call, tally)
    loss_per_gb = torch.stack(tally.losses) if tally.losses else torch.zeros(0, device=call.device)  # [num_gb]
    replica.comm.all_reduce_sum(loss_per_gb)
    if not call.eval_mode and optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        assert replica.scheduler is not None  # built with the optimizer
        replica.scheduler.step()  # once per train() call, not per optimizer step
    return {
        "loss": loss_per_gb.cpu(),
        "grad_norm": tally.grad_norm,
        "all_mb_metrics": dict(tally.metrics),
        "lr": tally.lr,
        "num_global_batches": tally.num_gb,
        "num_valid_seqs": tally.seqs,
        "num_valid_tokens": tally.toks,
    }


def _global_batch_bounds(rows: int, call: TrainCall, world: int, rank: int) -> list[tuple[int, int]]:
    """[start, end) of each global batch among this rank's `rows`: blocks of gbs / world, or the plan's."""
    if call.plan is None:
        local_gbs = call.gbs // world
        if local_gbs < 1 or local_gbs % call.mbs:
            raise ValueError(
                f"per-rank global batch {call.gbs}/{world}={local_gbs} is not a multiple of mbs={call.mbs}"
            )
        if rows % local_gbs:
            raise ValueError(f"{rows} rows on rank {rank} are not a multiple of the per-rank batch {local_gbs}")
        return [(gb * local_gbs, (gb + 1) * local_gbs) for gb in range(rows // local_gbs)]
    bounds = call.plan.gb_bounds()
    if (bounds[-1][1] if bounds else 0) != rows:
        raise ValueError(
            f"the micro-batch plan covers {sum(call.plan.elem_counts_per_gb)} rows, rank {rank} has {rows}"
        )
    return bounds


def _train_global_batch(
    replica: TrainingReplica, gb_data: BatchedDataDict, gb: int, loss: MicrobatchLoss, call: TrainCall, tally: _Tally
) -> None:
    """Global batch `gb`: every micro-batch's forward and backward, then one optimizer step (unless evaluating)."""
    seqs, toks = _global_counts(replica, gb_data, call.device)
    seqs_f, toks_f = float(seqs), float(toks)  # read once per global batch, not per micro-batch
    tally.seqs += seqs_f
    tally.toks += toks_f
    if not call.eval_mode and replica.optimizer is not None:
        replica.optimizer.zero_grad(set_to_none=True)
    gb_loss = torch.zeros((), device=call.device)
    wrapped = replica.dp.reduces_in_backward
    # samples before each row, read once for the global batch from the rows as they arrived (host memory), instead
    # of once per micro-batch from the device
    valid_rows = (gb_data["sample_mask"] > 0).long()  # [b]
    before = torch.cat([valid_rows.new_zeros(1), valid_rows.cumsum(0)]).tolist()  # [b+1]
    lengths = gb_data["input_lengths"].tolist() if call.plan is not None else None  # [b] host, for the cuts
    # the global batch moves to the device once (one copy per field); its micro-batches are cut there
    gb_data = gb_data.copy().to(call.device)
    num_mb, batches = _micro_batches_of(replica, gb_data, gb, call, wrapped, lengths)
    for i, (mb, replay, start, end) in enumerate(batches):
        valid = _is_valid(replica, mb, replay, wrapped, has_sample=before[end] > before[start])
        if not valid and not wrapped:
            continue  # no valid sample: contributes nothing to the loss, metrics or gradient
        with replica.dp.micro_batch(sync=i == num_mb - 1):
            mb_loss, mb_metrics = _forward_backward(replica, mb, loss if valid else None, seqs, toks, call.eval_mode)
        if valid:
            gb_loss += mb_loss.detach()
            record_microbatch_metrics(tally.metrics, mb_metrics, tally.num_gb, tally.lr, seqs_f, toks_f)
    if not call.eval_mode:
        tally.grad_norm = replica.step_optimizer()
    tally.losses.append(gb_loss)


def _global_counts(
    replica: TrainingReplica, gb_data: BatchedDataDict, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid sequences and valid tokens of the whole global batch (this rank's part summed over ranks)."""
    sample_mask = gb_data["sample_mask"].float()  # [b]
    counts = torch.stack([sample_mask.sum(), (replica.valid_tokens(gb_data).float() * sample_mask[:, None]).sum()]).to(
        device
    )  # [2]: valid sequences, valid tokens of this rank's part
    replica.comm.all_reduce_sum(counts)
    return counts[0], counts[1]


def _micro_batches_of(
    replica: TrainingReplica,
    gb_data: BatchedDataDict,
    gb: int,
    call: TrainCall,
    wrapped: bool,
    lengths: list[int] | None,
) -> tuple[int, Iterator[tuple[BatchedDataDict, bool, int, int]]]:
    """(how many, the micro-batches lazily, each with whether it is a zero-loss replay and its rows [start, end) of
    the global batch) of global batch `gb`."""
    if call.plan is None:
        num_mb, size = -(-gb_data.size // call.mbs), gb_data.size
        rows = ((start, min(start + call.mbs, size)) for start in range(0, size, call.mbs))  # micro_batches' blocks
        return num_mb, (
            (mb, False, *bounds)
            for mb, bounds in zip(replica.micro_batches(gb_data, call.mbs, call.device), rows, strict=True)
        )
    planned = call.plan.micro_batches(gb)
    if wrapped:  # every rank must run as many forward/backward passes as the busiest one
        busiest = max(replica.comm.all_gather_object(sum(m.end > m.start for m in planned)))
        planned = with_replays(planned, busiest)
    planned = [m for m in planned if m.end > m.start]
    return len(planned), ((cut(gb_data, m, lengths), m.replay, m.start, m.end) for m in planned)


def _is_valid(replica: TrainingReplica, mb: BatchedDataDict, replay: bool, wrapped: bool, has_sample: bool) -> bool:
    """Whether a micro-batch has a valid sample (and, under DDP / FSDP2, a loss position) to learn from."""
    valid = not replay and has_sample
    if wrapped and valid:  # no loss position: a dummy too (an FSDP2 backward must pass through every unit)
        valid = float((replica.valid_tokens(mb).float() * mb["sample_mask"].float()[:, None]).sum()) > 0
    return valid


def _forward_backward(
    replica: TrainingReplica,
    mb: BatchedDataDict,
    loss: MicrobatchLoss | None,
    seqs: torch.Tensor,
    toks: torch.Tensor,
    eval_mode: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One micro-batch through `replica.dp`: `loss` (None: the zero-loss dummy), then backward when it has a graph."""
    dp = replica.dp

    def closure() -> tuple[torch.Tensor, dict[str, Any]]:
        if loss is not None:
            value, mb_metrics = loss(mb, seqs, toks)
            if dp.reduces_in_backward and not eval_mode and not value.requires_grad:
                value = value + dp.zero_touch()  # no loss position (no graph): still reach the collectives
            return value, mb_metrics
        return replica.zero_loss(mb), {}  # a dummy: every rank must reach the same collectives

    value, mb_metrics = dp.forward(closure, training=not eval_mode)
    if not eval_mode and value.requires_grad:  # no graph: no loss position, zero gradient
        scaler = replica.grad_scaler
        dp.backward(value if scaler is None else scaler.scale(value))  # ddp/fsdp2: a timeout is one line
    return value, mb_metrics


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
    scaler: torch.amp.GradScaler | None = None,
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
    if scaler is not None:  # float16: the loss scale and its growth counter, for an exact resume
        state["grad_scaler"] = scaler.state_dict()
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
    scaler: torch.amp.GradScaler | None = None,
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
    if scaler is not None and "grad_scaler" in state:
        scaler.load_state_dict(state["grad_scaler"])
    dev.move_optimizer_state(optimizer, device)
    return int(state.get("weights_version", 0))

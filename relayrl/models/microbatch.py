"""Sequence packing and dynamic batching: how a data-parallel rank cuts its rows into micro-batches.

One planner serves both trainers (`plan_rows`): it deals the rows of each global batch over the ranks and plans each
rank's micro-batches. Sequence packing bins whole sequences under a token capacity with the data plane's packers
(`preshard.pack_bins`: a multiple of the rank count) and deals the bins by token load, the heaviest remaining bin to
the lightest rank, every rank the same number of bins (the reference deals them round-robin, which can leave one rank
with a bin's worth more work); dynamic batching is `preshard.dp_shard_rows` as is: rows sorted by length are dealt
round-robin and every rank runs one shared token-budget schedule. `packing_args(cfg, stage)` turns the
`sequence_packing` / `dynamic_batching` config into the planner's arguments. The data-plane façade ships the plan as
`KVBatchMeta.extra_info` (`micro_batch_indices`, `micro_batch_lengths`, `elem_counts_per_gb`); the legacy façade
(`plan_shards`) hands each rank a `PlannedBatch`, its rows plus the same metadata as a `ShardPlan`. A worker given
rows without a plan plans them itself (`local_plan`, one rank).

What a micro-batch is: rows [start, end) of a global batch, cut to `width` columns (dynamic batching: the planned
width; packing: the bin's longest row), so the loss sees the same per-sample tensors, only narrower. A packed bin
also runs as one packed sequence stream with per-sequence attention (`models.fast.forward`, `packed=True`).
Losses are normalised by global counts, so neither mode changes a result beyond float32 rounding (except a term the
loss normalises by its own micro-batch's count: `loss_fn.positive_example_nll_weight`, as in the reference). Under a
data-parallel wrapper that reduces in backward (ddp/fsdp2), `with_replays` tops a rank up to the largest micro-batch
count of any rank with zero-loss replays of its own micro-batches, so every rank reaches the same collectives.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from relayrl.config import PolicyConfig, ValueConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.preshard import dp_shard_rows, inverse_permutation, pack_bins
from relayrl.data_plane.schema import ELEM_COUNTS_PER_GB, MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS, round_up
from relayrl.distributed.batched_data_dict import BatchedDataDict

#: The planner arguments of one pass: budgets for training, or for the log-prob / reference / top-k / value passes.
STAGES = ("train_mb_tokens", "logprob_mb_tokens")
Mode = Literal["packing", "dynamic"]
PlannerArgs = tuple[dict[str, Any] | None, dict[str, Any] | None]
ModelConfig = PolicyConfig | ValueConfig


# ---------------------------------------------------------------------------------------------------- config
def batching_mode(cfg: ModelConfig) -> Mode | None:
    """`packing`, `dynamic` or None (plain micro-batches of fixed row counts) for a policy or value config."""
    if cfg.sequence_packing.enabled:
        return "packing"
    return "dynamic" if cfg.dynamic_batching.enabled else None


def mb_tokens(cfg: ModelConfig, stage: str) -> int:
    """The token budget of a micro-batch for `stage`: the configured one, else max length x the stage's rows."""
    if stage not in STAGES:
        raise ValueError(f"_packing_args: unknown stage key {stage!r} (expected one of {STAGES})")
    block = cfg.sequence_packing if cfg.sequence_packing.enabled else cfg.dynamic_batching
    given = block.train_mb_tokens if stage == "train_mb_tokens" else block.logprob_mb_tokens
    if given is not None:
        return given
    rows = cfg.train_micro_batch_size
    if stage == "logprob_mb_tokens":
        rows = cfg.logprob_batch_size or rows
    return cfg.max_total_sequence_length * rows


def packing_args(cfg: ModelConfig, stage: str) -> PlannerArgs:
    """(sequence_packing_args, dynamic_batching_args) for `stage` (`train_mb_tokens` / `logprob_mb_tokens`): at
    most one is set, fresh dicts every call; (None, None) when both modes are off."""
    budget = mb_tokens(cfg, stage)  # validates the stage name even when both modes are off
    mode = batching_mode(cfg)
    if mode == "dynamic":
        rnd = cfg.dynamic_batching.sequence_length_round
        return None, {"sequence_length_round": rnd, "max_tokens_per_microbatch": budget}
    if mode == "packing":
        sp = cfg.sequence_packing
        return {
            "algorithm": sp.algorithm,
            "sequence_length_pad_multiple": sp.sequence_length_round,
            "max_tokens_per_microbatch": budget,
            "microbatch_order": sp.microbatch_order,
        }, None
    return None, None


# ---------------------------------------------------------------------------------------------------- planning
def deal_bins(loads: list[int], dp: int) -> list[list[int]]:
    """Bin indices per rank: bins by decreasing load, each round of `dp` bins dealt heaviest-first to the ranks in
    order of increasing total load (ties: lower rank), so every rank gets len(loads) / dp bins and the totals stay
    within about one bin of each other. Each rank's bins stay in packer order."""
    per_rank: list[list[int]] = [[] for _ in range(dp)]
    totals = [0] * dp
    ordered = sorted(range(len(loads)), key=lambda b: (-loads[b], b))
    for start in range(0, len(ordered), dp):
        ranks = sorted(range(dp), key=lambda r: (totals[r], r))
        for b, r in zip(ordered[start : start + dp], ranks):
            per_rank[r].append(b)
            totals[r] += loads[b]
    return [sorted(bins) for bins in per_rank]


def plan_rows(
    lengths: list[int], dp: int, batch_size: int | None, args: PlannerArgs
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Row indices per rank (rank-local order) and each rank's plan metadata (`extra_info` keys), per chunk of
    `batch_size` rows (None: one chunk). Dynamic batching (or neither mode) is `preshard.dp_shard_rows`."""
    sp, db = args
    n = len(lengths)
    if sp is None:
        return dp_shard_rows(lengths, n, dp, batch_size=batch_size, dynamic_batching_args=db)
    chunk = batch_size or n
    if n == 0 or n % chunk:
        raise ValueError(f"Total batch size ({n}) is not a multiple of batch_size ({batch_size})")
    order = sp.get("microbatch_order", "packer")
    cap, multiple = int(sp["max_tokens_per_microbatch"]), int(sp["sequence_length_pad_multiple"])
    rows: list[list[int]] = [[] for _ in range(dp)]
    info: list[dict[str, Any]] = [
        {MICRO_BATCH_INDICES: [], MICRO_BATCH_LENGTHS: [], ELEM_COUNTS_PER_GB: []} for _ in rows
    ]
    for start in range(0, n, chunk):
        padded = [round_up(length, multiple) for length in lengths[start : start + chunk]]
        bins = pack_bins(padded, cap, str(sp["algorithm"]), min_bins=dp, multiple=dp)
        loads = [sum(padded[i] for i in b) for b in bins]
        for r, mine in enumerate(deal_bins(loads, dp)):
            if order == "largest_first":
                mine = sorted(mine, key=lambda b: -loads[b])
            bounds, at = [], 0
            for b in mine:
                bounds.append([at, at + len(bins[b])])
                at += len(bins[b])
            info[r][MICRO_BATCH_INDICES].append(bounds)
            info[r][MICRO_BATCH_LENGTHS].append([loads[b] for b in mine])
            info[r][ELEM_COUNTS_PER_GB].append(at)
            rows[r].extend(start + i for b in mine for i in bins[b])
    return rows, info


def shard_meta(meta: KVBatchMeta, dp: int, batch_size: int | None, args: PlannerArgs) -> list[KVBatchMeta]:
    """`preshard.shard_meta_for_dp` with `plan_rows` as the planner: one meta per rank, each with a copy of
    `meta.extra_info` plus its plan."""
    if meta.sequence_lengths is None:
        raise ValueError("sequence packing / dynamic batching requires meta.sequence_lengths populated")
    rows, info = plan_rows(meta.sequence_lengths, dp, batch_size, args)
    shards = []
    for idx, extra in zip(rows, info):
        shard = meta.subset(idx)
        shard.extra_info = {**meta.extra_info, **extra}
        shards.append(shard)
    return shards


# ---------------------------------------------------------------------------------------------------- plans
class MicroBatch(NamedTuple):
    """Rows [start, end) of a global batch; tensors of rank >= 2 cut to `width` columns (None: the longest row's)."""

    start: int
    end: int
    width: int | None
    replay: bool = False  # a zero-loss replay that only keeps a rank in step with its peers' collectives


@dataclass(frozen=True)
class ShardPlan:
    """One rank's micro-batches, per global batch: the planner's metadata as the data plane carries it."""

    mode: Mode
    micro_batch_indices: list[list[list[int]]]  # per global batch: [start, end) of each micro-batch
    micro_batch_lengths: list[list[int]]  # per global batch: planned width (dynamic) or padded tokens (packing)
    elem_counts_per_gb: list[int]  # rows of this rank in each global batch

    @classmethod
    def from_info(cls, mode: Mode, info: Mapping[str, Any]) -> ShardPlan | None:
        """The plan in a shard's `extra_info`; None when the driver planned nothing."""
        if MICRO_BATCH_INDICES not in info or MICRO_BATCH_LENGTHS not in info:
            return None
        indices = [[[int(a), int(b)] for a, b in gb] for gb in info[MICRO_BATCH_INDICES]]
        lengths = [[int(x) for x in gb] for gb in info[MICRO_BATCH_LENGTHS]]
        counts = info.get(ELEM_COUNTS_PER_GB)
        per_gb = (
            [int(c) for c in counts] if counts is not None else [max((b for _, b in gb), default=0) for gb in indices]
        )
        return cls(mode, indices, lengths, per_gb)

    def gb_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each global batch in the rank's rows."""
        ends = list(itertools.accumulate(self.elem_counts_per_gb))
        return [(end - count, end) for end, count in zip(ends, self.elem_counts_per_gb)]

    def micro_batches(self, gb: int) -> list[MicroBatch]:
        """Global batch `gb`'s micro-batches, empty ones (a short rank's tail) included."""
        widths = self.micro_batch_lengths[gb]
        return [
            MicroBatch(a, b, widths[i] if self.mode == "dynamic" else None)
            for i, (a, b) in enumerate(self.micro_batch_indices[gb])
        ]


class PlannedBatch(BatchedDataDict[Any]):
    """A rank's rows, in plan order, with the plan the driver made for them (slices and copies carry no plan)."""

    plan: ShardPlan | None = None

    @classmethod
    def of(cls, data: BatchedDataDict[Any], plan: ShardPlan | None) -> PlannedBatch:
        out = cls(data)
        out.plan = plan
        return out


def plan_of(data: BatchedDataDict[Any]) -> ShardPlan | None:
    return data.plan if isinstance(data, PlannedBatch) else None


def with_plan(data: BatchedDataDict[Any], cfg: ModelConfig, info: Mapping[str, Any]) -> BatchedDataDict[Any]:
    """A data-plane shard's rows carrying the driver's plan from its `extra_info` (as they are when both modes are
    off; a shard without a plan is planned on the worker)."""
    mode = batching_mode(cfg)
    return data if mode is None else PlannedBatch.of(data, ShardPlan.from_info(mode, info))


def _lengths(data: BatchedDataDict[Any]) -> list[int]:
    """Planner lengths: input_lengths, an empty row counting as one token (as the forward treats it)."""
    return [int(x) for x in data["input_lengths"].clamp(min=1).tolist()]


def plan_shards(
    data: BatchedDataDict[Any], dp: int, cfg: ModelConfig, stage: str, batch_size: int | None
) -> tuple[list[PlannedBatch], list[int] | None] | None:
    """The legacy façade's sharding under packing / dynamic batching: one `PlannedBatch` per rank and the inverse
    permutation (`concat(rank outputs)[unsorted]` is in input order; None when rows kept their order). None when
    both modes are off (the façade then shards as before)."""
    args = packing_args(cfg, stage)
    mode = batching_mode(cfg)
    if mode is None:
        return None
    rows, info = plan_rows(_lengths(data), dp, batch_size, args)
    shards = [PlannedBatch.of(data.select_indices(r), ShardPlan.from_info(mode, i)) for r, i in zip(rows, info)]
    return shards, inverse_permutation(rows)


def local_plan(
    data: BatchedDataDict[Any], cfg: ModelConfig, stage: str, batch_size: int | None
) -> tuple[BatchedDataDict[Any], ShardPlan, torch.Tensor]:
    """Plan rows that arrived without a plan on this rank alone: (rows in plan order, plan, original index of each
    row [n]). Only for direct calls: the façades plan on the driver so that every rank runs in step."""
    mode = batching_mode(cfg)
    if mode is None:
        raise ValueError("local_plan: neither sequence packing nor dynamic batching is enabled")
    rows, info = plan_rows(_lengths(data), 1, batch_size, packing_args(cfg, stage))
    plan = ShardPlan.from_info(mode, info[0])
    assert plan is not None
    return data.select_indices(rows[0]), plan, torch.tensor(rows[0], dtype=torch.long)


# ---------------------------------------------------------------------------------------------------- cutting
def with_replays(micro_batches: list[MicroBatch], count: int) -> list[MicroBatch]:
    """`micro_batches` without empty ones, topped up to `count` with replays of the rank's own (cyclically)."""
    real = [mb for mb in micro_batches if mb.end > mb.start]
    if not real and count > 0:
        raise ValueError("a rank without rows in a global batch cannot replay a micro-batch to keep in step")
    replays = [mb._replace(replay=True) for mb in itertools.islice(itertools.cycle(real), max(count - len(real), 0))]
    return real + replays


def cut(gb_data: BatchedDataDict[Any], mb: MicroBatch, lengths: list[int] | None = None) -> BatchedDataDict[Any]:
    """Rows [start, end) of `gb_data` with every tensor of rank >= 2 brought to the micro-batch's width: the planned
    one (dynamic batching; zero-padded when the batch is narrower, so both trainers see the same shapes whatever
    width their batches were padded to) or the longest row's (packing). Real tokens are never dropped. `lengths`:
    the rows' lengths read once on the host, so that cutting device tensors reads nothing back per micro-batch."""
    rows = gb_data.slice(mb.start, mb.end)
    seq = int(rows["input_ids"].shape[1])
    if mb.end <= mb.start:
        longest = 1
    else:
        longest = max(lengths[mb.start : mb.end]) if lengths is not None else int(rows["input_lengths"].max())
    width = max(mb.width or 0, min(longest, seq), 1)
    if width == seq:
        return rows
    for key, value in rows.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq:
            rows[key] = value[:, :width] if width < seq else torch.nn.functional.pad(value, _pad_dim1(value, width))
    return rows


def _pad_dim1(value: torch.Tensor, width: int) -> tuple[int, ...]:
    """`F.pad` widths that extend dim 1 of `value` to `width` (zeros; padding is never read as a token)."""
    return (0, 0) * (value.dim() - 2) + (0, width - value.shape[1])


def planned(
    data: BatchedDataDict[Any], cfg: ModelConfig, stage: str, batch_size: int | None
) -> tuple[BatchedDataDict[Any], ShardPlan | None, torch.Tensor | None]:
    """(rows in plan order, plan, original row of each row) on a worker: the driver's plan when the rows came with
    one, else one made here (`local_plan`); (data, None, None) when both modes are off."""
    if batching_mode(cfg) is None or data.size == 0:
        return data, None, None
    plan = plan_of(data)
    if plan is not None:
        return data, plan, None
    return local_plan(data, cfg, stage, batch_size)


def pass_batches(
    data: BatchedDataDict[Any], cfg: ModelConfig, size: int, device: torch.device
) -> Iterator[tuple[range | torch.Tensor, BatchedDataDict[Any]]]:
    """An inference pass's micro-batches as (their rows in `data`, the micro-batch on `device`): `size` rows each,
    or as planned under sequence packing / dynamic batching (each cut to its own width)."""
    ordered, plan, origin = planned(data, cfg, "logprob_mb_tokens", None)
    lengths = None if plan is None else ordered["input_lengths"].tolist()  # on the host, before the move
    ordered = ordered.copy().to(device)  # one copy per field for the whole pass, micro-batches cut on the device
    if plan is None:
        for start in range(0, data.size, size):
            yield range(start, min(start + size, data.size)), ordered.slice(start, min(start + size, data.size))
        return
    for mb in plan.micro_batches(0):
        if mb.end > mb.start:
            rows = range(mb.start, mb.end)
            yield (rows if origin is None else origin[mb.start : mb.end]), cut(ordered, mb, lengths)


def place(out: torch.Tensor, rows: range | torch.Tensor, part: torch.Tensor) -> None:
    """Write a micro-batch's result `part` [b, w, ...] into `out` [n, W, ...] at `rows`, columns [0, min(w, W)) (a
    micro-batch wider than the batch only adds padding columns)."""
    width = min(part.shape[1], out.shape[1])
    if isinstance(rows, range):
        out[rows.start : rows.stop, :width] = part[:, :width]
    else:
        out[rows, :width] = part[:, :width]

"""Metadata-only DP sharding of a `KVBatchMeta`: which keys each data-parallel rank fetches, plus the packing
metadata every rank must share so collectives line up. No I/O and no new keys.

Modes (per chunk of `batch_size` rows, one optimizer step each; `batch_size=None` means one chunk):
- none: contiguous pieces per rank;
- dynamic batching: stable sort by length, deal round-robin, plan micro-batches once for all ranks;
- sequence packing: pad lengths, bin-pack (capacity = max tokens), at least `dp` bins and a multiple of `dp`,
  deal bins round-robin; ranks get equal bin counts, not equal row counts.
Unlike the reference, a row count not divisible by the DP size is fine: ranks differ by at most one row (the
extra rows rotate over chunks) and packers may hand a rank empty bins. Loss normalisation stays global.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.schema import ELEM_COUNTS_PER_GB, MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS, round_up

PACKING_ALGORITHMS = ("concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing")
_IGNORED_ARG_KEYS = {"input_key", "input_lengths_key"}  # accepted for config compatibility; metas have no tensors


# ---------------------------------------------------------------------------------------------------- bin packers
def _first_fit(order: list[tuple[int, int]], cap: int) -> list[list[int]]:
    """Place each (index, size) in the first bin with room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for idx, size in order:
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(idx)
                room[b] -= size
                break
        else:
            bins.append([idx])
            room.append(cap - size)
    return bins


def _concatenative(sizes: list[int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    used = cap + 1
    for i, s in enumerate(sizes):
        if used + s > cap:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += s
    return bins


def _mffd(sizes: list[int], cap: int) -> list[list[int]]:
    """Johnson & Garey modified first-fit-decreasing: large items seed bins, mediums then small pairs join them,
    a greedy pass fills what is left, and leftovers go through FFD into bins kept sorted by fill."""
    large: list[tuple[int, int]] = []
    medium: list[tuple[int, int]] = []
    small: list[tuple[int, int]] = []
    tiny: list[tuple[int, int]] = []
    for item in enumerate(sizes):
        s = item[1]
        (large if s > cap / 2 else medium if s > cap / 3 else small if s > cap / 6 else tiny).append(item)
    large.sort(key=lambda x: -x[1])
    medium.sort(key=lambda x: -x[1])
    small.sort(key=lambda x: x[1])
    tiny.sort(key=lambda x: x[1])
    bins = [[item] for item in large]
    for b in bins:
        free = cap - b[0][1]
        pick = next((j for j, (_, s) in enumerate(medium) if s <= free), None)
        if pick is not None:
            b.append(medium.pop(pick))
    for b in reversed(bins):
        if any(cap / 3 < s <= cap / 2 for _, s in b) or len(small) < 2:
            continue
        free = cap - sum(s for _, s in b)
        if small[0][1] + small[1][1] > free:
            continue
        first = small.pop(0)
        second = next((j for j in range(len(small) - 1, -1, -1) if small[j][1] <= free - first[1]), None)
        if second is not None:
            b.extend([first, small.pop(second)])
    rest = sorted(medium + small + tiny, key=lambda x: -x[1])
    for b in bins:
        while rest:
            free = cap - sum(s for _, s in b)
            pick = next((j for j, (_, s) in enumerate(rest) if s <= free), None)
            if pick is None:
                break
            b.append(rest.pop(pick))
    # Leftovers: FFD where the emptiest bin is tried first (bins kept sorted by fill, ties keep insertion order).
    ffd: list[tuple[int, list[tuple[int, int]]]] = [(0, [])]
    for item in sorted(rest, key=lambda x: -x[1]):
        fill, content = ffd.pop(0) if item[1] <= cap - ffd[0][0] else (0, [])
        content.append(item)
        fill += item[1]
        at = next((j for j, (f, _) in enumerate(ffd) if f > fill), len(ffd))
        ffd.insert(at, (fill, content))
    return [[i for i, _ in b] for b in [*bins, *(c for _, c in ffd)] if b]


def pack_bins(sizes: list[int], cap: int, algorithm: str, *, min_bins: int, multiple: int) -> list[list[int]]:
    """Bins of indices into `sizes`; bin count >= `min_bins` and a multiple of `multiple`. Extra bins take the
    last item of the fullest-by-count bins; when there are too few items, the extra bins stay empty."""
    too_big = [s for s in sizes if s > cap]
    if too_big:
        raise ValueError(f"Sequence length {too_big[0]} exceeds bin capacity {cap}")
    if any(s <= 0 for s in sizes):
        raise ValueError("sequence packing needs positive sequence lengths")
    if algorithm == "concatenative":
        bins = _concatenative(sizes, cap)
    elif algorithm == "first_fit_decreasing":
        bins = _first_fit(sorted(enumerate(sizes), key=lambda x: (-x[1], -x[0])), cap)
    elif algorithm == "first_fit_shuffle":
        order = list(enumerate(sizes))
        random.Random(len(sizes)).shuffle(order)
        bins = _first_fit(order, cap)
    elif algorithm == "modified_first_fit_decreasing":
        bins = _mffd(sizes, cap)
    else:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; expected one of {PACKING_ALGORITHMS}")
    target = round_up(max(len(bins), min_bins), multiple)
    sources = sorted(range(len(bins)), key=lambda b: (len(bins[b]), b), reverse=True)  # ties: later bin first
    src = 0
    while len(bins) < target:
        while src < len(sources) and len(bins[sources[src]]) <= 1:
            src += 1
        bins.append([bins[sources[src]].pop()] if src < len(sources) else [])
    return bins


# ---------------------------------------------------------------------------------------------------- planning
def _check_args(args: Mapping[str, Any], required: set[str], optional: set[str], what: str) -> None:
    missing = required - set(args)
    unknown = set(args) - required - optional - _IGNORED_ARG_KEYS
    if missing or unknown:
        raise ValueError(f"{what}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")


def _even_sizes(n: int, parts: int, shift: int) -> list[int]:
    """Sizes of `parts` pieces of `n` differing by at most one; the extra rows start at rank `shift`."""
    base, extra = divmod(n, parts)
    return [base + (1 if (r - shift) % parts < extra else 0) for r in range(parts)]


def dp_shard_rows(
    lengths: list[int] | None,
    n: int,
    dp_world_size: int,
    *,
    batch_size: int | None = None,
    sequence_packing_args: Mapping[str, Any] | None = None,
    dynamic_batching_args: Mapping[str, Any] | None = None,
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Row indices per rank (in rank-local order) and per-rank packing metadata for `extra_info`."""
    if dp_world_size < 1:
        raise ValueError(f"dp_world_size must be >= 1, got {dp_world_size}")
    if n == 0:
        raise ValueError("shard_meta_for_dp: empty meta, nothing to shard")
    if sequence_packing_args is not None and dynamic_batching_args is not None:
        raise ValueError("Pass at most one of sequence_packing_args and dynamic_batching_args")
    packing = sequence_packing_args is not None or dynamic_batching_args is not None
    if packing and lengths is None:
        raise ValueError("sequence packing / dynamic batching requires meta.sequence_lengths populated")
    chunk = batch_size or n
    if chunk < 1 or n % chunk:
        raise ValueError(f"Total batch size ({n}) is not a multiple of batch_size ({batch_size})")
    dp = dp_world_size
    rows: list[list[int]] = [[] for _ in range(dp)]
    info: list[dict[str, Any]] = [{} for _ in range(dp)]
    if packing:
        for r in range(dp):
            info[r] = {MICRO_BATCH_INDICES: [], MICRO_BATCH_LENGTHS: [], ELEM_COUNTS_PER_GB: []}
    for c, start in enumerate(range(0, n, chunk)):
        ids = list(range(start, start + chunk))
        shift = (c * (chunk % dp)) % dp
        if sequence_packing_args is not None:
            assert lengths is not None
            per_rank = _seqpack_chunk(ids, lengths, dp, sequence_packing_args, info)
        elif dynamic_batching_args is not None:
            assert lengths is not None
            per_rank = _dynbatch_chunk(ids, lengths, dp, shift, dynamic_batching_args, info)
        else:
            per_rank, at = [], 0
            for size in _even_sizes(chunk, dp, shift):
                per_rank.append(ids[at : at + size])
                at += size
        for r in range(dp):
            rows[r].extend(per_rank[r])
            if packing:
                info[r][ELEM_COUNTS_PER_GB].append(len(per_rank[r]))
    return rows, info


def _dynbatch_chunk(
    ids: list[int], lengths: list[int], dp: int, shift: int, args: Mapping[str, Any], info: list[dict[str, Any]]
) -> list[list[int]]:
    _check_args(args, {"sequence_length_round", "max_tokens_per_microbatch"}, set(), "dynamic_batching_args")
    cap, rnd = int(args["max_tokens_per_microbatch"]), int(args["sequence_length_round"])
    ordered = sorted(ids, key=lambda i: lengths[i])  # stable: ties keep row order
    per_rank: list[list[int]] = [[] for _ in range(dp)]
    for p, i in enumerate(ordered):
        per_rank[(p + shift) % dp].append(i)
    depth = max(len(r) for r in per_rank)
    widths = []
    for k in range(depth):
        longest = max(lengths[r[k]] for r in per_rank if k < len(r))
        width = round_up(longest, rnd)
        if width > cap:
            raise ValueError(
                f"dynamic batching: a sequence of length {longest} (rounded {width}) exceeds "
                f"max_tokens_per_microbatch={cap}; it would be truncated"
            )
        widths.append(width)
    bounds: list[list[int]] = []
    mb_lengths: list[int] = []
    for k, w in enumerate(widths):
        if bounds and (k - bounds[-1][0] + 1) * max(mb_lengths[-1], w) <= cap:
            bounds[-1][1] = k + 1
            mb_lengths[-1] = max(mb_lengths[-1], w)
        else:
            bounds.append([k, k + 1])
            mb_lengths.append(w)
    for r in range(dp):  # same micro-batch count on every rank; a short rank's last one may be smaller or empty
        mine = len(per_rank[r])
        info[r][MICRO_BATCH_INDICES].append([[min(a, mine), min(b, mine)] for a, b in bounds])
        info[r][MICRO_BATCH_LENGTHS].append(list(mb_lengths))
    return per_rank


def _seqpack_chunk(
    ids: list[int], lengths: list[int], dp: int, args: Mapping[str, Any], info: list[dict[str, Any]]
) -> list[list[int]]:
    _check_args(
        args,
        {"algorithm", "sequence_length_pad_multiple", "max_tokens_per_microbatch"},
        {"microbatch_order"},
        "sequence_packing_args",
    )
    order = args.get("microbatch_order")
    if order not in (None, "packer", "largest_first"):
        raise ValueError(f"microbatch_order must be None, 'packer' or 'largest_first', got {order!r}")
    padded = [round_up(lengths[i], int(args["sequence_length_pad_multiple"])) for i in ids]
    bins = pack_bins(padded, int(args["max_tokens_per_microbatch"]), str(args["algorithm"]), min_bins=dp, multiple=dp)
    per_rank: list[list[int]] = []
    for r in range(dp):
        mine = bins[r::dp]
        tokens = [sum(padded[j] for j in b) for b in mine]
        if order == "largest_first":
            ranked = sorted(range(len(mine)), key=lambda b: -tokens[b])
            mine, tokens = [mine[b] for b in ranked], [tokens[b] for b in ranked]
        bounds, at = [], 0
        for b in mine:
            bounds.append([at, at + len(b)])
            at += len(b)
        info[r][MICRO_BATCH_INDICES].append(bounds)
        info[r][MICRO_BATCH_LENGTHS].append(tokens)
        per_rank.append([ids[j] for b in mine for j in b])
    return per_rank


def shard_meta_for_dp(
    meta: KVBatchMeta,
    dp_world_size: int,
    *,
    batch_size: int | None = None,
    sequence_packing_args: Mapping[str, Any] | None = None,
    dynamic_batching_args: Mapping[str, Any] | None = None,
) -> list[KVBatchMeta]:
    """One meta per DP rank (rank order). Keys, sequence lengths and tags move in lockstep; every shard gets a
    copy of `meta.extra_info` plus its own packing metadata (`micro_batch_indices`, `micro_batch_lengths`,
    `elem_counts_per_gb`) when packing args are given."""
    rows, info = dp_shard_rows(
        meta.sequence_lengths,
        meta.size,
        dp_world_size,
        batch_size=batch_size,
        sequence_packing_args=sequence_packing_args,
        dynamic_batching_args=dynamic_batching_args,
    )
    shards = []
    for r, idx in enumerate(rows):
        shard = meta.subset(idx)
        shard.extra_info = {**meta.extra_info, **info[r]}
        shards.append(shard)
    return shards


def inverse_permutation(rank_rows: list[list[int]]) -> list[int] | None:
    """`unsorted` such that `concat(rank results)[unsorted]` is in original row order; None if already in order."""
    flat = [i for rows in rank_rows for i in rows]
    if flat == list(range(len(flat))):
        return None
    out = [0] * len(flat)
    for j, i in enumerate(flat):
        out[i] = j
    return out

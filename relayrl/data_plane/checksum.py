"""Per-row checksums of data-plane fields: computed by the client that puts a column, kept by the store's ledger
beside the field's written marks, and compared by the client that gets the column back.

Why a digest of our own rather than `zlib.crc32` per row or `torch.hash_tensor`: a field's rows are slices of one
packed tensor, so the digest is a handful of vectorised integer ops over the whole column, on the column's own
device (a GPU tensor is digested on the GPU; only `[N]` int64 digests move). It is a position-weighted sum of the
raw bits, modulo 2**64:

    digest(row) = fold( sum_j (word_j + C) * M * (2 j + 1)  +  len(row) * L )

with `word_j` the row's bits read as integers (the widest of 8/4/2/1 bytes that divides one token), `j` the word's
position in the row and M, L odd constants. Any change of a single word changes the 64-bit sum (an odd factor
times a non-zero difference is non-zero modulo 2**64), swapped words change it (their weights differ), a row of
repeated values zeroed changes it (unlike an XOR fold, equal words do not cancel), and a changed jagged length
changes it. The sum is folded to 63 bits (bit 63 into bit 0) so that -1 can mean "no checksum recorded"; the fold
hides a change only if it moves the sum by exactly 2**63 +- 1. It is not a cryptographic hash: it guards against
corruption, not against an adversary.

This module is only the digest (it imports nothing of the client API, so the checkpoint code can use it too); the
getting client's comparison is `proxy.verify_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from relayrl.data_plane.codec import Column

NO_CHECKSUM = -1
"""The ledger's mark for a (row, field) written without a checksum (by a client with verification off)."""

_M = 0x5851F42D4C957F2D  # odd multipliers below 2**63
_L = 0x14057B7EF767814F
_C = 0x2545F4914F6CDD1D
_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_LOW63 = (1 << 63) - 1


def _words(values: torch.Tensor) -> torch.Tensor:
    """`values` `[R, *trailing]` as `[R, W]` integer words of its raw bits (R rows or tokens, W words each)."""
    r = values.shape[0]
    flat = values.detach().contiguous().reshape(r, math.prod(values.shape[1:]))  # [R, D]
    width = flat.shape[1] * flat.element_size()  # bytes per row/token
    if width == 0:
        return torch.zeros(r, 1, dtype=torch.int64, device=flat.device)
    word = _WORD[next(s for s in (8, 4, 2, 1) if width % s == 0)]
    if flat.dtype != word:
        flat = flat.view(torch.uint8).view(word)  # reinterpret the bits, never cast: [R, width / word size]
    return flat


def row_digests(col: Column) -> torch.Tensor:
    """`[N]` int64 digests (>= 0), one per row of `col`, computed on `col`'s device and returned on the CPU.

    CPU columns go through numpy (a few microseconds per op instead of torch's dispatch); other devices through
    the same integer arithmetic in torch, so the two give equal digests."""
    return torch.from_numpy(_row_digests(col))


def _row_digests(col: Column) -> np.ndarray:
    if col.num_rows == 0:
        return np.zeros(0, dtype=np.int64)
    words = _words(col.values)  # [T or N, W]
    if words.device.type == "cpu":
        lengths = None if col.lengths is None else col.lengths.numpy()
        return _digests_numpy(words.numpy(), lengths)
    return _digests_torch(words, col.lengths).cpu().numpy()


_weights_cache = np.zeros(0, dtype=np.uint64)


def _weights_numpy(n: int) -> np.ndarray:
    """`[n]` word weights `M (2 g + 1)` for positions g < n, from a cache grown by doubling (the same few sizes
    recur every step)."""
    global _weights_cache
    cache = _weights_cache
    if cache.shape[0] < n:
        g = np.arange(max(n, 2 * cache.shape[0], 4096), dtype=np.uint64)
        cache = (g * np.uint64(2) + np.uint64(1)) * np.uint64(_M)
        _weights_cache = cache
    return cache[:n]


def _digests_numpy(words: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """`[N]` digests of `[R, W]` integer words; uint64 arithmetic wraps modulo 2**64."""
    width = words.shape[1]
    x = words.astype(np.int64, copy=False).view(np.uint64) + np.uint64(_C)  # [R, W], sign-extended like torch
    if lengths is None:  # dense: row i is x[i]
        return _fold_numpy((x * _weights_numpy(width)).sum(1, dtype=np.uint64))
    # Row-relative weights without a per-token row index: with g the word's position in the flat column and s the
    # row's first word, sum x M (2(g-s)+1) = sum x M (2g+1) - 2 M s sum x: two segment sums over the flat column.
    flat = x.reshape(-1)  # [T * W]
    words_per_row = lengths.astype(np.uint64) * np.uint64(width)  # [N]
    starts = np.cumsum(words_per_row) - words_per_row  # [N]
    weighted = np.zeros(lengths.shape[0], dtype=np.uint64)
    plain = np.zeros(lengths.shape[0], dtype=np.uint64)
    full = np.flatnonzero(words_per_row)  # rows with words; reduceat over their starts sums exactly each row
    if full.shape[0]:
        at = starts[full].astype(np.int64)
        weighted[full] = np.add.reduceat(flat * _weights_numpy(flat.shape[0]), at, dtype=np.uint64)
        plain[full] = np.add.reduceat(flat, at, dtype=np.uint64)
    h = weighted - plain * starts * np.uint64(2 * _M)  # [N]
    return _fold_numpy(h + lengths.astype(np.uint64) * np.uint64(_L))


def _fold_numpy(h: np.ndarray) -> np.ndarray:
    """63-bit digest as int64: the top bit is folded into bit 0, so a change confined to it is still seen."""
    return ((h & np.uint64(_LOW63)) ^ (h >> np.uint64(63))).view(np.int64)


def _as_int64(v: int) -> int:
    """The int64 with the same low 64 bits as `v`."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _digests_torch(words: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """`_digests_numpy` in torch, on the words' device (int64 arithmetic wraps modulo 2**64 there too)."""
    dev, width = words.device, words.shape[1]
    x = words.to(torch.int64) + _C  # [R, W]
    if lengths is None:
        w = (torch.arange(width, device=dev) * 2 + 1) * _M  # [W]
        return _fold_torch((x * w).sum(1))
    flat = x.reshape(-1)  # [T * W]
    g = torch.arange(flat.shape[0], device=dev)
    lens = lengths.to(dev)
    bounds = torch.zeros(lens.shape[0] + 1, dtype=torch.int64, device=dev)  # [N + 1]
    torch.cumsum(lens * width, 0, out=bounds[1:])
    weighted = _prefix_torch(flat * ((g * 2 + 1) * _M)).index_select(0, bounds)  # [N + 1]
    plain = _prefix_torch(flat).index_select(0, bounds)  # [N + 1]
    h = weighted.diff() - plain.diff() * bounds[:-1] * _as_int64(2 * _M)  # [N]
    return _fold_torch(h + lens * _L)


def _prefix_torch(t: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(t.shape[0] + 1, dtype=torch.int64, device=t.device)
    torch.cumsum(t, 0, out=out[1:])
    return out


def _fold_torch(h: torch.Tensor) -> torch.Tensor:
    low = torch.tensor(_LOW63, device=h.device)
    return (h & low) ^ ((h >> 63) & 1)


def batch_digests(cols: Mapping[str, Column]) -> dict[str, torch.Tensor]:
    """`{field: [N] digests}` for a put's columns."""
    return {name: row_digests(col) for name, col in cols.items()}

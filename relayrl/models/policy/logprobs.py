"""From hidden states to token log-probabilities without a full [B, S, V] float32 tensor.

The vocabulary projection is the memory peak of every policy pass: B·S·V float32 logits plus their log-softmax.
These helpers apply the LM head and an fp32 log-softmax a few sequence positions at a time and keep only what the
caller needs (the target token's log-prob, or the top-k logits). During training each chunk is recomputed in the
backward pass (activation checkpointing of the head), so the training peak is one chunk too.

Filtering follows the generation engine's sampler so training-side log-probs describe the same distribution that
produced the samples: top-k keeps every logit >= the k-th largest (ties kept); top-p then keeps the smallest set of
the highest-probability tokens whose mass reaches top_p (renormalised over the top-k survivors), always keeping
the most likely token.

Where generation recorded the sampler's own kept set per token (`generation_support`, see
`sampling.support_record`), that set is the filter instead: the trainer's logits can differ from the sampler's
(bf16 generation, a stale producer), and a filter recomputed from them would not be the support the token was drawn
from. Positions without a record (none made, or an overflowing one) recompute it as above.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from relayrl.models.generation.sampling import SUPPORT_OVERFLOW, cumulative_probs, support_mask

#: Float32 bytes one [rows, chunk, V] slab may use when no chunk size is configured.
DEFAULT_CHUNK_BUDGET_BYTES = 64 * 2**20
#: ... in a no-grad pass over a packed micro-batch (sequence packing), whose thousands of positions would otherwise
#: make each slab larger than the buffers the CPU allocator keeps for reuse (32 MiB, `cluster.retain_freed_memory`):
#: every chunk's logits would be page-faulted in afresh.
PACKED_CHUNK_BUDGET_BYTES = 8 * 2**20

#: On an accelerator: the share of the memory free at the first pass one slab may use, and the largest budget.
DEVICE_FREE_SHARE = 16
MAX_DEVICE_CHUNK_BUDGET_BYTES = 2**30
_device_budgets: dict[str, int] = {}

LMHead = Callable[[torch.Tensor], torch.Tensor]  # [B, C, H] -> [B, C, V] logits (any float dtype)


def auto_chunk_size(rows: int, vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES) -> int:
    """Positions per chunk so that one [rows, chunk, V] float32 tensor stays within `budget_bytes`."""
    return max(1, budget_bytes // max(1, rows * vocab_size * 4))


def chunk_budget_bytes(device: torch.device, packed: bool = False) -> int:
    """Bytes one [rows, chunk, V] float32 slab may use on `device`. On the CPU the fixed budgets above (`packed`:
    the no-grad packed one). On a CUDA device a sixteenth of the memory free when first asked (the model loaded),
    rounded down to a power of two within [64 MiB, 1 GiB], then kept for the process: a GPU's head runs in few,
    large chunks, and every pass of a run cuts the same chunks (chunk widths can change a GEMM's bits)."""
    if device.type != "cuda":
        return PACKED_CHUNK_BUDGET_BYTES if packed else DEFAULT_CHUNK_BUDGET_BYTES
    key = str(torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device()))
    if key not in _device_budgets:
        free, _total = torch.cuda.mem_get_info(torch.device(key))
        share = min(max(free // DEVICE_FREE_SHARE, DEFAULT_CHUNK_BUDGET_BYTES), MAX_DEVICE_CHUNK_BUDGET_BYTES)
        _device_budgets[key] = 1 << (share.bit_length() - 1)
    return _device_budgets[key]


def filtering_active(top_k: int | None, top_p: float) -> bool:
    """Whether `top_k`/`top_p` remove any token at all (top_k None or <= 0 and top_p == 1 are no-ops)."""
    return (top_k is not None and top_k > 0) or top_p < 1.0


def top_k_top_p_mask(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Boolean [..., V] mask of the logits the sampler would *drop* (True = filtered out)."""
    vocab = logits.shape[-1]
    with torch.no_grad():
        flat = logits.detach().reshape(-1, vocab)  # [N, V]
        ascending, order = flat.sort(dim=-1)  # [N, V]
        drop = torch.zeros_like(ascending, dtype=torch.bool)
        if top_k is not None and 0 < top_k < vocab:
            kth_largest = ascending[:, vocab - top_k].unsqueeze(-1)  # [N, 1]
            drop |= ascending < kth_largest
        if top_p < 1.0:
            probs = ascending.masked_fill(drop, float("-inf")).softmax(dim=-1)  # [N, V]
            drop |= cumulative_probs(probs) <= 1.0 - top_p  # the sampler's sums (deterministic off the CPU)
            drop[:, -1] = False  # the most likely token always survives
        unsorted = torch.empty_like(drop).scatter_(-1, order, drop)  # back to vocabulary order
    return unsorted.view(logits.shape)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Logits with the sampler's dropped entries set to -inf (differentiable w.r.t. the kept entries)."""
    if not filtering_active(top_k, top_p):
        return logits
    return logits.masked_fill(top_k_top_p_mask(logits, top_k, top_p), float("-inf"))


def support_metrics(
    mismatch: list[torch.Tensor], support: torch.Tensor, keep: torch.Tensor, global_toks: torch.Tensor
) -> dict[str, float]:
    """A micro-batch's `sampling/*` counts: loss tokens whose recorded kept set differs from the filter the trainer
    recomputes from its own logits (`support_mismatch`, and as a fraction of the global batch's loss tokens), and
    sampled tokens whose kept set was too large to record (`support_unrecorded`: the trainer's filter was used).
    `support` [b, S-1, K], `keep` [b, S-1]: the loss positions."""
    count = float(sum(int(m.sum()) for m in mismatch))
    unrecorded = float(((support[..., 0] == SUPPORT_OVERFLOW) & keep.to(support.device)).sum())
    return {
        "sampling/support_mismatch": count,
        "sampling/support_mismatch_fraction": count / max(float(global_toks), 1.0),
        "sampling/support_unrecorded": unrecorded,
    }


def _chunk_bounds(num_positions: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, num_positions)) for s in range(0, num_positions, chunk_size)]


def _target_logprobs(
    h: torch.Tensor,  # [..., H]
    tgt: torch.Tensor,  # [...]
    lm_head: LMHead,
    temperature: float,
    top_k: int | None,
    top_p: float,
    want_unfiltered: bool,
    support: torch.Tensor | None = None,  # [..., K] the sampler's recorded kept sets (`sampling.support_record`)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(filtered log-prob, unfiltered log-prob, support mismatch) of each target, [...] each (the unfiltered one is the
    filtered tensor unless `want_unfiltered`; the mismatch, bool, flags recorded positions where the filter
    recomputed from these logits keeps another set than the recorded one: None without `support`)."""
    logits = lm_head(h).float() / temperature  # [..., V]
    plain = None
    if want_unfiltered:
        plain = logits.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [...]
    mismatch = None
    if support is not None and filtering_active(top_k, top_p):
        own_drop = top_k_top_p_mask(logits, top_k, top_p)  # [..., V]
        kept, recorded = support_mask(support.to(logits.device), logits.shape[-1])  # [..., V], [...]
        drop = torch.where(recorded.unsqueeze(-1), ~kept, own_drop)  # [..., V]
        mismatch = recorded & (own_drop != drop).any(dim=-1)  # [...]
        logits = logits.masked_fill(drop, float("-inf"))
    elif filtering_active(top_k, top_p):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    lp = logits.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [...]
    return lp, (plain if plain is not None else lp), mismatch


def next_token_logprobs(
    hidden: torch.Tensor,  # [B, S, H] final hidden states (after the final norm)
    lm_head: LMHead,
    input_ids: torch.Tensor,  # [B, S]
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    chunk_size: int | None = None,
    return_unfiltered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(x_{t+1} | x_<=t) for t = 0..S-2, as float32 [B, S-1], chunk by chunk along the sequence.

    Logits are divided by `temperature` and filtered by `top_k`/`top_p` before the log-softmax; a target outside
    the kept set gets -inf. With `return_unfiltered` the temperature-only log-probs come back as well (same shape),
    for a KL term that must see the whole distribution. When gradients are enabled each chunk's head + softmax is
    recomputed in backward instead of stored.
    """
    batch, seq = input_ids.shape
    num_positions = seq - 1
    filtered = filtering_active(top_k, top_p)
    want_unfiltered = return_unfiltered and filtered
    if num_positions <= 0:
        empty = hidden.new_zeros(batch, 0, dtype=torch.float32)
        return empty, (empty if return_unfiltered else None)
    targets = input_ids[:, 1:].to(hidden.device)  # [B, S-1]

    def chunk_fn(h: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp, plain, _ = _target_logprobs(h, tgt, lm_head, temperature, top_k, top_p, want_unfiltered)
        return lp, plain

    if chunk_size is None:
        vocab = _vocab_size(lm_head, hidden)
        chunk_size = auto_chunk_size(batch, vocab, chunk_budget_bytes(hidden.device))
    # Recompute chunks in backward only when there are several: one chunk already fits the memory budget.
    recompute = torch.is_grad_enabled() and hidden.requires_grad and num_positions > chunk_size
    outs, plains = [], []
    for start, end in _chunk_bounds(num_positions, chunk_size):
        h, tgt = hidden[:, start:end], targets[:, start:end]
        if recompute:
            lp, plain = checkpoint(chunk_fn, h, tgt, use_reentrant=False)
        else:
            lp, plain = chunk_fn(h, tgt)
        outs.append(lp)
        plains.append(plain)
    logprobs = torch.cat(outs, dim=1)  # [B, S-1]
    if not return_unfiltered:
        return logprobs, None
    return logprobs, (torch.cat(plains, dim=1) if want_unfiltered else logprobs)


def selected_logprobs(
    hidden: torch.Tensor,  # [M, H] final hidden states of the selected positions
    lm_head: LMHead,
    targets: torch.Tensor,  # [M] the token each position predicts
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    chunk_size: int | None = None,
    return_unfiltered: bool = False,
    support: torch.Tensor | None = None,  # [M, K] the sampler's recorded kept sets, or None
    mismatch_out: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`next_token_logprobs` for packed positions: float32 [M] (and the unfiltered copy when asked), `chunk_size`
    positions at a time, each chunk recomputed in backward when there are several. With `support` the recorded kept
    sets replace the recomputed filter where present, and `mismatch_out` (if given) receives each chunk's
    support-mismatch flags (`_target_logprobs`)."""
    filtered = filtering_active(top_k, top_p)
    want_unfiltered = return_unfiltered and filtered
    num = hidden.shape[0]
    targets = targets.to(hidden.device)
    if chunk_size is None:
        chunk_size = auto_chunk_size(1, _vocab_size(lm_head, hidden), chunk_budget_bytes(hidden.device))
    recompute = torch.is_grad_enabled() and hidden.requires_grad and num > chunk_size
    outs, plains = [], []
    for start, end in _chunk_bounds(num, chunk_size):
        part = None if support is None else support[start:end]
        args = (hidden[start:end], targets[start:end], lm_head, temperature, top_k, top_p, want_unfiltered, part)
        if recompute:
            lp, plain, mismatch = checkpoint(_target_logprobs, *args, use_reentrant=False)
        else:
            lp, plain, mismatch = _target_logprobs(*args)
        if mismatch_out is not None and mismatch is not None:
            mismatch_out.append(mismatch)
        outs.append(lp)
        plains.append(plain)
    if not outs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if return_unfiltered else None)
    logprobs = torch.cat(outs) if len(outs) > 1 else outs[0]  # [M]
    if not return_unfiltered:
        return logprobs, None
    if not want_unfiltered:
        return logprobs, logprobs
    return logprobs, (torch.cat(plains) if len(plains) > 1 else plains[0])


def topk_logits(
    hidden: torch.Tensor,  # [B, S, H]
    lm_head: LMHead,
    k: int,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k temperature-scaled logits and their vocabulary ids at positions 0..S-2: ([B, S-1, k], [B, S-1, k])."""
    batch, seq = hidden.shape[:2]
    num_positions = max(seq - 1, 0)
    vocab = _vocab_size(lm_head, hidden)
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, vocab_size={vocab}], got {k}")
    if chunk_size is None:
        chunk_size = auto_chunk_size(batch, vocab, chunk_budget_bytes(hidden.device))
    values, indices = [], []
    for start, end in _chunk_bounds(num_positions, chunk_size):
        logits = lm_head(hidden[:, start:end]).float() / temperature  # [B, C, V]
        v, i = logits.topk(k, dim=-1)  # [B, C, k]
        values.append(v)
        indices.append(i)
    if not values:
        return hidden.new_zeros(batch, 0, k, dtype=torch.float32), torch.zeros(batch, 0, k, dtype=torch.long)
    return torch.cat(values, dim=1), torch.cat(indices, dim=1)


def token_aligned(next_token: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """[B, S-1] next-token values -> token-aligned [B, S]: entry t = value for token t, 0 at t=0 and t >= length."""
    batch = next_token.shape[0]
    out = torch.cat([next_token.new_zeros(batch, 1), next_token], dim=1)  # [B, S]
    positions = torch.arange(out.shape[1], device=out.device)  # [S]
    return out.masked_fill(positions[None, :] >= input_lengths.to(out.device)[:, None], 0.0)


def zero_invalid(logprobs: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Replace -inf (target filtered out) and positions where `keep` is False by 0; same shape."""
    valid = torch.isfinite(logprobs)
    if keep is not None:
        valid &= keep.to(device=logprobs.device, dtype=torch.bool)
    return torch.where(valid, logprobs, torch.zeros_like(logprobs))


def _vocab_size(lm_head: LMHead, hidden: torch.Tensor) -> int:
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    with torch.no_grad():
        return int(lm_head(hidden[:1, :1]).shape[-1])

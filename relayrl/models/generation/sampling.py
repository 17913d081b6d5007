"""Token sampling for the generation engines (temperature, vLLM-compatible top-k / top-p, greedy) and the tests
that end a row (stop tokens, stop strings).

The engine must report the log-prob of each sampled token under the distribution it *actually* sampled from
(after temperature and filtering), so the sampler returns both in one pass. Sampling uses the inverse CDF
(one uniform per row, a cumulative sum and a binary search) instead of `torch.multinomial` or Gumbel noise over the
whole vocabulary: it draws B random numbers instead of B x V and is several times cheaper per decode step on CPU.
The engine passes the uniforms in (drawn up front, one per row and step), so a row's sample never depends on which
other rows share its batch: any split of a batch across generation workers samples the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relayrl.models.fast.kernels import load_cpu_kernels


def apply_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the logits outside the top-k / top-p set, with vLLM's semantics.

    top-k keeps every logit >= the k-th largest (ties at the boundary are kept). top-p sorts ascending, and drops the
    tokens whose cumulative probability is <= 1 - top_p, always keeping the most likely token. top-k applies first.
    Returns a new tensor; `logits` is not modified. `logits`: [..., V] float.
    """
    vocab = logits.shape[-1]
    k = top_k if top_k is not None and 0 < top_k < vocab else None
    use_p = top_p < 1.0
    if k is None and not use_p:
        return logits
    if k is not None and not use_p:
        kth = logits.topk(k, dim=-1).values[..., -1:]  # [..., 1]
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1)  # ascending, [..., V]
    if k is not None:
        kth = sorted_logits[..., vocab - k : vocab - k + 1]  # [..., 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = cumulative_probs(sorted_logits.softmax(dim=-1))  # [..., V]
    drop = cum <= 1.0 - top_p
    drop[..., -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(-1, order, sorted_logits)


def filter_active(top_k: int | None, top_p: float) -> bool:
    """Whether top-k / top-p can drop any token (top_k None or <= 0 and top_p == 1 drop none)."""
    return (top_k is not None and top_k > 0) or top_p < 1.0


#: `support_record` entry of a token whose kept set was larger than the record's width (nothing else recorded).
SUPPORT_OVERFLOW = -1


def support_record(filtered: torch.Tensor, width: int) -> torch.Tensor:
    """The sampler's kept set per row as int32 [B, width]: kept token id + 1, ascending, then 0 (empty slots).

    Ids are stored shifted by one so that an all-zero row (any padding) means "nothing recorded". A row whose kept
    set has more than `width` tokens is recorded as [SUPPORT_OVERFLOW, 0, ...]: the trainer then recomputes the
    filter for that token and counts it. `filtered`: [B, V] logits with the dropped entries at -inf."""
    k = min(width, filtered.shape[-1])
    # One more than the record holds: a finite (k+1)-th value means the kept set does not fit (cheaper than counting
    # the finite entries of the whole row). Every kept id is among the first k when at most k are kept.
    values, ids = filtered.topk(min(k + 1, filtered.shape[-1]), dim=-1)  # [B, k(+1)]
    overflow = torch.isfinite(values[:, k:]).any(dim=-1, keepdim=True)  # [B, 1] (False when k = V)
    record = torch.where(torch.isfinite(values[:, :k]), ids[:, :k] + 1, 0).to(torch.int32)  # [B, k]
    record = torch.where(record > 0, record, torch.iinfo(torch.int32).max).sort(dim=-1).values
    record = record.masked_fill(record == torch.iinfo(torch.int32).max, 0)  # [B, k]
    marker = torch.zeros_like(record[:1])  # [1, k]: what an overflowing row holds (no host sync to find them)
    marker[0, 0] = SUPPORT_OVERFLOW
    record = torch.where(overflow, marker, record)  # [B, k]
    if k < width:
        record = torch.nn.functional.pad(record, (0, width - k))
    return record  # [B, width]


def support_mask(record: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [..., V] bool, recorded [...] bool) from `support_record` rows [..., K]; `kept` is all False where
    nothing was recorded (all-zero rows and overflow rows)."""
    record = record.long()
    recorded = record[..., 0] > 0  # [...]
    slots = torch.where(record > 0, record - 1, vocab).reshape(-1, record.shape[-1])  # [N, K]; empty: spare column
    rows = torch.arange(slots.shape[0], device=record.device).unsqueeze(1).expand_as(slots)  # [N, K]
    kept = torch.zeros((slots.shape[0], vocab + 1), dtype=torch.bool, device=record.device)  # [N, V + 1]
    # index_put_ (not scatter_): it has a deterministic CUDA kernel under torch.use_deterministic_algorithms
    kept.index_put_(
        (rows.reshape(-1), slots.reshape(-1)), torch.ones(slots.numel(), dtype=torch.bool, device=record.device)
    )
    return kept[:, :vocab].reshape(*record.shape[:-1], vocab), recorded


def support_output(lengths: torch.Tensor, width: int, support: torch.Tensor, gen_len: torch.Tensor) -> torch.Tensor:
    """The recorded kept sets [B, N, K] in the engine's output layout [B, S_in + N, K] (the columns of its
    generated tokens; zeros, "nothing recorded", elsewhere)."""
    batch, max_new, k = support.shape
    generated = torch.arange(max_new).unsqueeze(0) < gen_len.unsqueeze(1)  # [B, N]
    cols = (lengths.unsqueeze(1) + torch.arange(max_new).unsqueeze(0)).unsqueeze(-1).expand(-1, -1, k)  # [B, N, K]
    out = torch.zeros((batch, width + max_new, k), dtype=torch.int32)
    return out.scatter_(1, cols, support.masked_fill(~generated.unsqueeze(-1), 0))


class TokenSampler:
    """Turns next-token logits [B, V] into (tokens [B], log-probs [B]) under fixed sampling settings."""

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
        native: bool = False,
        record_support: int = 0,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if not greedy and generator is None:
            raise ValueError("sampling needs a torch.Generator (reproducibility); pass generator=")
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = float(top_p)
        self.greedy = greedy
        self.generator = generator
        # relayrl's compiled CPU sampler (fast.kernels): the same draw in one call instead of ~10 ops per step.
        self.native = native and not greedy and top_k is None and top_p >= 1.0 and load_cpu_kernels()
        # Width of the kept-set record (`support_record`); 0: nothing recorded (greedy, or no filter to record).
        self.record_support = record_support if not greedy and filter_active(top_k, top_p) else 0
        self.last_support: torch.Tensor | None = None  # [B, K] int32, the last call's record when recording

    def __call__(self, logits: torch.Tensor, uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row; return (tokens int64 [B], log-prob of each token float32 [B]).

        `uniforms` [B] in [0, 1): the draw of each row (else one is drawn per row from the generator)."""
        scaled = logits.float()  # [B, V]
        if self.temperature != 1.0:
            scaled = scaled / self.temperature
        if self.greedy:
            # argmax of the raw logits, scored under the temperature-scaled (unfiltered) distribution.
            tokens = scaled.argmax(dim=-1, keepdim=True)  # [B, 1]
            logprobs = scaled.log_softmax(dim=-1)  # [B, V]
            return tokens.squeeze(1), logprobs.gather(1, tokens).squeeze(1)
        filtered = apply_top_k_top_p(scaled, self.top_k, self.top_p)  # [B, V]
        if self.record_support:
            self.last_support = support_record(filtered, self.record_support)  # [B, K]
        probs = filtered.softmax(dim=-1)  # [B, V]
        if self.native and uniforms is not None and probs.device.type == "cpu" and probs.dtype == torch.float32:
            return torch.ops.relayrl_cpu.sample_inverse_cdf(probs, uniforms.to(torch.float32).reshape(-1))
        tokens = sample_inverse_cdf(probs, self.generator, uniforms)  # [B, 1]
        # log of the gathered probability: one [B, V] pass fewer than a log_softmax, same value to ~1e-7.
        return tokens.squeeze(1), probs.gather(1, tokens).log_().squeeze(1)


#: Fixed-point CDFs count probability in units of 2**-FIXED_POINT_BITS (int64 sums stay far below 2**63).
FIXED_POINT_BITS = 40


def fixed_point_cdf(probs: torch.Tensor) -> torch.Tensor:
    """Integer cumulative sums [..., V] of probs in units of 2**-FIXED_POINT_BITS (int64).

    Why: a float cumsum on CUDA has no deterministic kernel (it raises under `torch.use_deterministic_algorithms`);
    an integer one is exact, so any kernel gives the same result. A probability below 2**-40 counts as zero."""
    return (probs.double() * 2.0**FIXED_POINT_BITS).floor_().long().cumsum(dim=-1)


def cumulative_probs(probs: torch.Tensor) -> torch.Tensor:
    """probs.cumsum(-1); off the CPU, the fixed-point sums as floats (deterministic on every device). CPU keeps the
    float cumsum, so CPU samples and filters are unchanged."""
    if probs.device.type == "cpu":
        return probs.cumsum(dim=-1)
    return (fixed_point_cdf(probs).double() * 2.0**-FIXED_POINT_BITS).to(probs.dtype)


def sample_inverse_cdf(
    probs: torch.Tensor,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
    *,
    fixed_point: bool | None = None,
) -> torch.Tensor:
    """One draw per row from `probs` [B, V] (rows sum to ~1; zero-probability tokens are never drawn) -> [B, 1].

    The first index whose cumulative probability exceeds u * total (u ~ U[0, 1)) is the sample; a zero-probability
    token shares its predecessor's cumulative value, so a strict search never lands on it. `fixed_point` (default:
    off the CPU) sums integer units of 2**-40 instead of floats (`fixed_point_cdf`): no float cumsum, which CUDA
    refuses under deterministic mode; the CPU keeps the float CDF, whose samples the reference runs pin.
    """
    if fixed_point if fixed_point is not None else probs.device.type != "cpu":
        return _sample_fixed_point(probs, generator, uniforms)
    cdf = probs.cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    if uniforms is None:
        u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)  # [B, 1]
    else:
        u = uniforms.to(device=probs.device, dtype=cdf.dtype).reshape(-1, 1)  # [B, 1]
    # Keep the target strictly below the total even after rounding, so the search always finds a real token.
    # (The zero is cached: one allocation fewer per decode step.)
    target = torch.minimum(u * total, torch.nextafter(total, _zero(total)))  # [B, 1]
    return torch.searchsorted(cdf, target, right=True)  # [B, 1]


def _sample_fixed_point(
    probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None
) -> torch.Tensor:
    """`sample_inverse_cdf` on an integer CDF: target = floor(u * total) < total, first index whose sum exceeds it."""
    cdf = fixed_point_cdf(probs)  # [B, V] int64
    total = cdf[:, -1:]  # [B, 1]
    if uniforms is None:
        u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=torch.float64)
    else:
        u = uniforms.to(device=probs.device, dtype=torch.float64).reshape(-1, 1)  # [B, 1]
    target = torch.minimum((u * total.double()).floor_().long(), total - 1)  # [B, 1]
    return torch.searchsorted(cdf, target, right=True)  # [B, 1]


_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _zero(like: torch.Tensor) -> torch.Tensor:
    """A cached 0-dim zero of `like`'s device and dtype (broadcasts; saves one allocation per decode step)."""
    key = (like.device, like.dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = torch.zeros((), device=like.device, dtype=like.dtype)
    return zero


# ---------------------------------------------------------------------------------------------------- stopping
def stop_test(stop_ids: list[int], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """tokens [b] -> bool [b], whether each is a stop token (scalar compares for one or two ids: cheaper than isin)."""
    if not stop_ids:
        return lambda tok: torch.zeros(tok.shape, dtype=torch.bool, device=tok.device)
    if len(stop_ids) == 1:
        return lambda tok: tok == stop_ids[0]
    if len(stop_ids) == 2:
        return lambda tok: (tok == stop_ids[0]).logical_or_(tok == stop_ids[1])
    ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
    return lambda tok: torch.isin(tok, ids)


class StopStringMatcher:
    """Ends a row once its decoded generated text contains one of its stop strings (checked on the host).

    Only the tail of each row is decoded: a stop string completed by the newest token spans at most its UTF-8
    byte length in tokens (every token is at least one byte), so a few tokens more than that suffice, and the
    check costs the same at token 10 as at token 10,000.
    """

    def __init__(self, tokenizer: Any, row_stops: list[list[str]]) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: no Python post-processing
        if backend is not None:
            self.decode = lambda ids: backend.decode(ids, skip_special_tokens=False)
        else:
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        self.row_stops = row_stops
        self.generated: dict[int, list[int]] = {i: [] for i, stops in enumerate(row_stops) if stops}
        self.window = {i: 4 + max(len(s.encode("utf-8")) for s in row_stops[i]) for i in self.generated}

    def check(self, rows: torch.Tensor, tokens: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Append this step's tokens and return, per live slot, whether a stop string just completed."""
        hits = []
        for row, tok, live in zip(rows.tolist(), tokens.tolist(), alive.tolist()):
            ids = self.generated.get(row)
            if ids is None or not live:
                hits.append(False)
                continue
            ids.append(tok)
            text = self.decode(ids[-self.window[row] :])
            hits.append(any(s in text for s in self.row_stops[row]))
        return torch.tensor(hits, dtype=torch.bool, device=tokens.device)

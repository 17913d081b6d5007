"""Causal attention of the fast path's full-sequence passes, with a faster CPU form for short bf16 rows.

Why: PyTorch's CPU flash-attention kernel is built for long rows. At the widths a CPU trains at (a few hundred
tokens at most, head dim 32-128) its bf16 backward costs 4-5x its forward, and attention was a quarter of a
25M-parameter bf16 GRPO training step (`bench/attention.py`). For such rows `causal_attention` computes the whole
[B, H, S, S] score tensor with batched products instead:

* forward: scores as one float32 product of q and k (upcast, so the logits are as exact as the flash kernel's
  float32 accumulation), causal mask, softmax in float32, probabilities rounded to bf16 for the value product;
* backward: dP = dO V^T in float32 (it is cancelled against rowsum(dO * O)), the softmax derivative in float32, the
  three gradient products (dv, dq, dk) in bf16 -- the split a GPU flash kernel makes.

Outputs and gradients agree with the flash kernel's to bf16 rounding (tested against float64). Forward and backward
together take 0.53-0.66 of the flash kernel's time up to 128 tokens; the forward alone 0.9-1.3x its time; it runs
with and without gradients all the same, so a log-prob pass and the training forward agree bit for bit. float32
(the default, unchanged bit for bit), float16, every GPU, rows wider than `DENSE_MAX_WIDTH` and score tensors above
`DENSE_MAX_ELEMENTS` keep `F.scaled_dot_product_attention`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: Widest row (tokens) the dense form takes: it computes every score, masked ones included, so wider rows are the
#: flash kernel's (`bench/attention.py`, forward + backward, dense/flash: 0.53-0.66 at 64-128 tokens, 1.09-1.17 at 192).
DENSE_MAX_WIDTH = 128
#: Largest [B, H, S, S] the dense form materialises (2^25 elements: 64 MiB of bf16 probabilities kept for the
#: backward, 128 MiB of float32 scores while they are computed); bigger calls keep the flash kernel.
DENSE_MAX_ELEMENTS = 1 << 25

_CAUSAL_MASKS: dict[int, torch.Tensor] = {}


def _causal_mask(width: int) -> torch.Tensor:
    """[S, S] True above the diagonal (the keys a query may not see); one per width, made once."""
    mask = _CAUSAL_MASKS.get(width)
    if mask is None:
        mask = _CAUSAL_MASKS[width] = torch.ones(width, width, dtype=torch.bool).triu_(1)
    return mask


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would compute q in: autocast's on the CPU (it casts float32 inputs down), else q's own."""
    if q.device.type == "cpu" and q.dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return q.dtype


def dense_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `causal_attention` takes the dense form for q [B, H, S, D] and k [B, H, S, D]."""
    b, h, s, _ = q.shape
    return (
        q.device.type == "cpu"
        and compute_dtype(q) == torch.bfloat16
        and k.shape[-2] == s
        and s <= DENSE_MAX_WIDTH
        and b * h * s * s <= DENSE_MAX_ELEMENTS
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of q, k, v [B, H, S, D] (k and v already repeated to q's heads): [B, H, S, D] in the
    compute dtype (under CPU autocast, float32 inputs are cast down first, as autocast does for SDPA)."""
    if dense_applies(q, k):
        # one cast per input, into the [B, H, S, D] layout (the callers' are transposed views), so that no
        # product below copies its operands again
        low, layout = torch.bfloat16, torch.contiguous_format
        q, k, v = (x.to(low, memory_format=layout) for x in (q, k, v))
        out: torch.Tensor = _DenseCausalAttention.apply(q, k, v, scale)
        return out
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _dense_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, S, D], probabilities [B, H, S, S] in q's dtype); autocast off: the dtypes are chosen here."""
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 (float64 in the tests of the algebra)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2))  # [B, H, S, S]
    scores.mul_(scale).masked_fill_(_causal_mask(q.shape[-2]), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [B, H, S, S]
    return torch.matmul(probs, v), probs  # [B, H, S, D]


class _DenseCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            out, probs = _dense_forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, probs, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, probs, out = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            g = grad_out.to(q.dtype).contiguous()  # [B, H, S, D]
            dv = torch.matmul(probs.transpose(-1, -2), g)  # [B, H, S, D]
            acc = torch.promote_types(q.dtype, torch.float32)
            # dP in float32: dP - rowsum(dO * O) cancels, and a bf16 dP would leave its rounding in dS
            dp = torch.matmul(g.to(acc), v.to(acc).transpose(-1, -2))  # [B, H, S, S]
            # softmax derivative: dS = P * (dP - rowsum(dO * O)), scaled as the scores were
            delta = (g.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # [B, H, S, 1]
            ds = dp.sub_(delta).mul_(probs.to(acc)).mul_(ctx.scale).to(q.dtype)  # [B, H, S, S]
            dq = torch.matmul(ds, k)  # [B, H, S, D]
            dk = torch.matmul(ds.transpose(-1, -2), q)
        return dq, dk, dv, None

"""CPU time of causal attention in bf16: PyTorch's flash kernel vs relayrl's dense form (`models/fast/attention.py`).

Why: the dense form replaces the flash kernel in the fast path's bf16 CPU passes up to `DENSE_MAX_WIDTH` tokens;
this measures where it pays, forward + backward (a training pass) and forward alone (a log-prob pass), at the
25M bench model's head shape (8 heads of 64) and a fixed number of tokens per call, widths 64 to 512. Both forms
run interleaved, round after round, so a change in machine load hits both alike; CPU time (time.process_time),
medians, one thread. Also prints each form's error against a float64 computation from the same bf16 inputs.

    python bench/attention.py --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from relayrl.models.fast.attention import DENSE_MAX_WIDTH, _DenseCausalAttention

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
HEADS, HEAD_DIM = 8, 64


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out: torch.Tensor = _DenseCausalAttention.apply(q, k, v, scale)
    return out


def one_call(fn: Attn, qkv: list[torch.Tensor], grad: torch.Tensor, backward: bool) -> float:
    start = time.process_time()
    if backward:
        fn(*qkv, HEAD_DIM**-0.5).backward(grad)
    else:
        with torch.no_grad():
            fn(*qkv, HEAD_DIM**-0.5)
    return time.process_time() - start


def errors(width: int) -> dict[str, tuple[float, float]]:
    """Mean |output - float64| and mean relative |dq - float64| per form, on random unit-variance inputs."""
    torch.manual_seed(0)
    base = [torch.randn(4, HEADS, width, HEAD_DIM) for _ in range(3)]
    grad = torch.randn(4, HEADS, width, HEAD_DIM)

    def run(fn: Attn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = [x.to(dtype).requires_grad_() for x in base]
        out = fn(*t, HEAD_DIM**-0.5)
        out.backward(grad.to(dtype))
        assert t[0].grad is not None
        return out.detach().double(), t[0].grad.double()

    want_out, want_dq = run(flash, torch.float64)
    res = {}
    for name, fn in (("flash", flash), ("dense", dense)):
        out, dq = run(fn, torch.bfloat16)
        res[name] = ((out - want_out).abs().mean().item(), ((dq - want_dq).abs().mean() / want_dq.abs().mean()).item())
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9, help="timed calls per form and width (after one warm-up)")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 96, 128, 192, 256, 512])
    p.add_argument("--tokens", type=int, default=4096, help="rows x width per call")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(
        f"bf16 causal attention, {HEADS} heads x {HEAD_DIM}, {args.tokens} tokens a call; CPU ms, medians of "
        f"{args.rounds}; relayrl takes the dense form up to {DENSE_MAX_WIDTH} tokens"
    )
    print(
        f"{'width':>5} {'rows':>4} | {'flash f+b':>9} {'dense f+b':>9} {'ratio':>5} | {'flash f':>7} {'dense f':>7} "
        f"{'ratio':>5} | error out (flash, dense); rel. error dq (flash, dense)"
    )
    for width in args.widths:
        rows = max(1, args.tokens // width)
        qkv = [torch.randn(rows, HEADS, width, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        grad = torch.randn(rows, HEADS, width, HEAD_DIM, dtype=torch.bfloat16)
        times: dict[tuple[str, bool], list[float]] = {}
        for r in range(args.rounds + 1):
            for name, fn in (("flash", flash), ("dense", dense)):
                for backward in (True, False):
                    t = one_call(fn, qkv, grad, backward)
                    if r:
                        times.setdefault((name, backward), []).append(t * 1e3)
        med = {key: statistics.median(v) for key, v in times.items()}
        err = errors(width)
        fb_f, fb_d, f_f, f_d = med[("flash", True)], med[("dense", True)], med[("flash", False)], med[("dense", False)]
        print(
            f"{width:>5} {rows:>4} | {fb_f:>9.1f} {fb_d:>9.1f} {fb_d / fb_f:>5.2f} | {f_f:>7.1f} {f_d:>7.1f} "
            f"{f_d / f_f:>5.2f} | {err['flash'][0]:.2e}, {err['dense'][0]:.2e}; "
            f"{err['flash'][1]:.2e}, {err['dense'][1]:.2e}"
        )


if __name__ == "__main__":
    main()

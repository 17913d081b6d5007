"""The dense bf16 CPU attention against float64 and against the flash kernel it stands in for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relayrl.models.fast import attention
from relayrl.models.fast.attention import DENSE_MAX_WIDTH, causal_attention, dense_applies

HEADS, DIM = 4, 32
SCALE = DIM**-0.5


def _inputs(rows: int, width: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(rows, HEADS, width, DIM, generator=g) for _ in range(3)]
    return qkv, torch.randn(rows, HEADS, width, DIM, generator=g)


def _run(qkv: list[torch.Tensor], grad: torch.Tensor, dtype: torch.dtype, dense: bool) -> list[torch.Tensor]:
    """[output, dq, dk, dv] as float64, from the dense form or SDPA (flash on the CPU)."""
    leaves = [x.to(dtype).requires_grad_() for x in qkv]
    if dense:
        out = attention._DenseCausalAttention.apply(*leaves, SCALE)
    else:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=SCALE)
    out.backward(grad.to(dtype))
    return [out.detach().double()] + [x.grad.double() for x in leaves if x.grad is not None]


@pytest.mark.parametrize("width", [1, 9, 64, DENSE_MAX_WIDTH])
def test_dense_bf16_is_as_close_to_float64_as_the_flash_kernel(width: int) -> None:
    qkv, grad = _inputs(3, width)
    exact = _run(qkv, grad, torch.float64, dense=False)
    flash = _run(qkv, grad, torch.bfloat16, dense=False)
    dense = _run(qkv, grad, torch.bfloat16, dense=True)
    for name, want, f, d in zip(["out", "dq", "dk", "dv"], exact, flash, dense, strict=True):
        scale = want.abs().mean().clamp_min(1e-2)  # one key: dq and dk are exactly 0
        err_flash, err_dense = (f - want).abs().mean() / scale, (d - want).abs().mean() / scale
        # bf16 rounding (2^-9 relative) is the floor of both; the dense form keeps within 1.5x the flash kernel's
        assert err_dense < 1.5 * err_flash + 1e-3, (name, err_dense.item(), err_flash.item())
        assert err_dense < 2e-2, name


def test_float64_dense_form_is_exact() -> None:
    """The algebra of the hand-written backward (softmax derivative, scale, causal mask), without rounding."""
    qkv, grad = _inputs(2, 17, seed=1)
    for want, got in zip(_run(qkv, grad, torch.float64, False), _run(qkv, grad, torch.float64, True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_which_calls_take_the_dense_form() -> None:
    q = torch.zeros(2, HEADS, 16, DIM)
    assert not dense_applies(q, q)  # float32: SDPA, bit for bit as before
    assert dense_applies(q.bfloat16(), q.bfloat16())
    assert not dense_applies(q.half(), q.half())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dense_applies(q, q)  # autocast would cast SDPA's float32 inputs to bf16
    wide = torch.zeros(1, 1, DENSE_MAX_WIDTH + 1, DIM, dtype=torch.bfloat16)
    assert not dense_applies(wide, wide)
    many = torch.zeros(attention.DENSE_MAX_ELEMENTS // 16**2 + 1, 1, 16, DIM, dtype=torch.bfloat16)
    assert not dense_applies(many, many)


def test_float32_calls_are_sdpa_bit_for_bit() -> None:
    qkv, _ = _inputs(2, 12)
    assert torch.equal(causal_attention(*qkv, SCALE), F.scaled_dot_product_attention(*qkv, is_causal=True, scale=SCALE))


def test_autocast_output_and_no_grad_pass_match_the_training_forward() -> None:
    """Under CPU autocast the float32 projections go through the dense form in bf16 (SDPA's dtype there), and a
    no-grad call returns the training forward's values bit for bit (a log-prob pass equals the training pass)."""
    qkv, grad = _inputs(2, 20)
    leaves = [x.clone().requires_grad_() for x in qkv]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train = causal_attention(*leaves, SCALE)
        with torch.no_grad():
            scored = causal_attention(*qkv, SCALE)
    assert train.dtype == torch.bfloat16
    assert torch.equal(train, scored)
    train.backward(grad.bfloat16())
    assert all(x.grad is not None and x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0 for x in leaves)
    # the causal mask: a query's output does not depend on later keys
    later = [x.clone() for x in qkv]
    later[1][:, :, 10:] += 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        moved = causal_attention(*later, SCALE)
    assert torch.equal(moved[:, :, :10], scored[:, :, :10])
    assert not torch.equal(moved[:, :, 10:], scored[:, :, 10:])

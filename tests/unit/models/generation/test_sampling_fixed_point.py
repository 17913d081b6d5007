"""The fixed-point inverse-CDF sampler (used off the CPU): no float cumsum, so CUDA's deterministic mode accepts it,
and it draws from the same distribution as the CPU's float CDF."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from relayrl.models.generation.sampling import cumulative_probs, fixed_point_cdf, sample_inverse_cdf


class NoFloatCumsum(TorchFunctionMode):
    """Raises on a floating-point cumsum, as CUDA does under `torch.use_deterministic_algorithms(True)`."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.cumsum, torch.Tensor.cumsum) and args[0].is_floating_point():
            raise RuntimeError("cumsum_cuda_kernel does not have a deterministic implementation")
        return func(*args, **kwargs)


def _probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, ::7] = float("-inf")  # zero-probability tokens
    return logits.softmax(-1)  # [B, V]


def test_fixed_point_sampler_uses_no_float_cumsum_and_matches_the_float_cdf() -> None:
    probs = _probs(64, 300, seed=0)
    u = torch.rand(64, generator=torch.Generator().manual_seed(1))
    with NoFloatCumsum():
        fixed = sample_inverse_cdf(probs, None, u, fixed_point=True)  # [B, 1]
    floats = sample_inverse_cdf(probs, None, u)  # the CPU default: float cumsum, unchanged
    assert (fixed == floats).float().mean() >= 0.98  # only draws within ~2**-40 of a boundary may differ
    assert not bool((fixed % 7 == 0).any())  # never a zero-probability token


def test_fixed_point_sampler_draws_the_distribution() -> None:
    probs = _probs(1, 20, seed=2).expand(40000, 20)
    gen = torch.Generator().manual_seed(3)
    tokens = sample_inverse_cdf(probs, gen, fixed_point=True).squeeze(1)
    freq = torch.bincount(tokens, minlength=20).double() / tokens.numel()
    assert float((freq - probs[0].double()).abs().max()) < 0.01
    assert float(freq[::7].sum()) == 0.0


def test_fixed_point_sums_are_exact_and_cpu_keeps_float_cumsum() -> None:
    probs = _probs(4, 50, seed=4)
    cdf = fixed_point_cdf(probs)
    assert cdf.dtype == torch.int64
    assert torch.equal(cdf[:, -1], (probs.double() * 2.0**40).floor().long().sum(-1))  # no rounding in the sum
    assert torch.equal(cumulative_probs(probs), probs.cumsum(-1))  # CPU: bit-identical to before

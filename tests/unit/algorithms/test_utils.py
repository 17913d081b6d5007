"""masked_mean / masked_var, KL estimators, per-prompt baselines and driver-side metric reduction."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.utils import (
    aggregate_train_metrics,
    calculate_baseline_and_std_per_prompt,
    calculate_kl,
    masked_mean,
    masked_var,
)

T = torch.tensor


# ------------------------------------------------------------------------------------------------ masked mean / var
def test_masked_mean_zero_mask_is_zero() -> None:
    assert masked_mean(T([1.0, 2.0, 3.0]), T([0.0, 0.0, 0.0])).item() == 0.0


def test_masked_mean_single_entry() -> None:
    assert masked_mean(T([1.0, 2.0, 3.0, 4.0]), T([1.0, 0.0, 0.0, 0.0])).item() == pytest.approx(1.0, abs=1e-6)


def test_masked_mean_dim_with_zero_mask() -> None:
    out = masked_mean(T([[1.0, 2.0], [3.0, 4.0]]), torch.zeros(2, 2), dim=1)
    assert out.tolist() == [0.0, 0.0]


def test_masked_mean_dim_and_global_factor() -> None:
    v = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = T([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert masked_mean(v, m, dim=1).tolist() == pytest.approx([1.5, 5.5])
    # global factor replaces the local count: (1 + 2 + 5 + 6) / 7
    assert masked_mean(v, m, global_normalization_factor=T(7.0)).item() == pytest.approx(2.0)


def test_masked_var_unbiased_and_biased() -> None:
    v = T([1.0, 2.0, 4.0, 100.0])
    m = T([1.0, 1.0, 1.0, 0.0])
    # mean 7/3, squared deviations 16/9, 1/9, 25/9 -> sum 42/9
    assert masked_var(v, m, unbiased=False).item() == pytest.approx(42 / 9 / 3, rel=1e-5)
    assert masked_var(v, m).item() == pytest.approx(42 / 9 / 2, rel=1e-5)
    assert masked_var(v, m, mean=T(0.0), unbiased=False).item() == pytest.approx(21 / 3, rel=1e-5)


def test_masked_var_single_entry_has_no_bessel_blowup() -> None:
    assert masked_var(T([3.0, 9.0]), T([1.0, 0.0])).item() == 0.0


# ------------------------------------------------------------------------------------------------ KL
@pytest.mark.parametrize(
    ("kl_type", "unclamped", "clamped"),
    [
        ("k1", [-1.0, 14.0, 29.0], [-1.0, 10.0, 10.0]),
        ("k2", [0.5, 98.0, 420.5], [0.5, 10.0, 10.0]),
        ("k3", [math.e - 2, 13.0, 28.0], [math.e - 2, 10.0, 10.0]),
    ],
)
def test_calculate_kl_types_and_clamps(kl_type: str, unclamped: list[float], clamped: list[float]) -> None:
    lp, ref = T([-1.0, -1.0, -1.0]), T([0.0, -15.0, -30.0])
    raw = calculate_kl(lp, ref, kl_type, input_clamp_value=None, output_clamp_value=None)
    assert raw.tolist() == pytest.approx(unclamped, abs=1e-3)
    assert calculate_kl(lp, ref, kl_type, 20.0, 10.0).tolist() == pytest.approx(clamped, abs=1e-4)


def test_calculate_kl_k3_huge_ratio_is_finite_only_with_input_clamp() -> None:
    lp, ref = T([-200.0]), T([0.0])
    assert torch.isinf(calculate_kl(lp, ref, "k3", None, None)).all()
    assert calculate_kl(lp, ref, "k3", 20.0, None).item() == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_calculate_kl_invalid_type() -> None:
    with pytest.raises(ValueError, match="Invalid KL type"):
        calculate_kl(T([0.0]), T([0.0]), "k4")


def test_input_clamp_detaches_importance_weights() -> None:
    lp = T([-3.0, -1.0], requires_grad=True)
    w = torch.exp(lp - lp.detach())
    kl = calculate_kl(lp, torch.zeros(2), "k3", 2.0, None, importance_sampling_weights=w)
    assert kl.tolist() == pytest.approx([math.exp(2) - 3, math.e - 2], abs=1e-5)
    kl.sum().backward()
    # clamped position: no gradient at all; free position: k3 + w * d k3/d lp = (e - 2) - (e - 1) = -1
    assert lp.grad.tolist() == pytest.approx([0.0, -1.0], abs=1e-5)


def test_output_clamp_after_weighting_zeroes_gradient() -> None:
    lp = T([-1.0], requires_grad=True)
    w = 100 * torch.exp(lp - lp.detach())
    kl = calculate_kl(lp, torch.zeros(1), "k3", None, 1.0, importance_sampling_weights=w)
    assert kl.item() == pytest.approx(1.0)
    kl.sum().backward()
    assert lp.grad.item() == 0.0


# ------------------------------------------------------------------------------------------------ baselines
def _two_groups(n0: int, n1: int) -> torch.Tensor:
    return T([[0, 0]] * n0 + [[1, 1]] * n1)


def test_baseline_loo_two_groups_of_three() -> None:
    base, std = calculate_baseline_and_std_per_prompt(_two_groups(3, 3), T([1.0, 2, 3, 4, 5, 6]), torch.ones(6))
    assert base.tolist() == pytest.approx([2.5, 2.0, 1.5, 5.5, 5.0, 4.5])
    assert std.tolist() == pytest.approx([0.7071, 1.4142, 0.7071] * 2, abs=1e-4)


def test_baseline_non_loo_is_group_mean_and_sample_std() -> None:
    base, std = calculate_baseline_and_std_per_prompt(
        _two_groups(3, 3), T([1.0, 2, 3, 4, 5, 9]), torch.ones(6), leave_one_out_baseline=False
    )
    assert base.tolist() == pytest.approx([2.0] * 3 + [6.0] * 3)
    # group 1: deviations -2, -1, 3 -> var (4+1+9)/2 = 7
    assert std.tolist() == pytest.approx([1.0] * 3 + [math.sqrt(7)] * 3, abs=1e-5)


def test_baseline_default_config_example() -> None:
    base, std = calculate_baseline_and_std_per_prompt(T([[7]] * 4), T([0.0, 1, 1, 0]), torch.ones(4))
    assert base.tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3, 2 / 3], abs=1e-6)
    assert std.tolist() == pytest.approx([0.57735] * 4, abs=1e-5)
    adv = (T([0.0, 1, 1, 0]) - base) / (std + 1e-6)
    assert adv.tolist() == pytest.approx([-1.1547, 1.1547, 1.1547, -1.1547], abs=1e-4)


def test_baseline_single_row_groups_and_identical_rewards() -> None:
    base, std = calculate_baseline_and_std_per_prompt(T([[1], [2], [3]]), T([0.3, 0.5, 0.9]), torch.ones(3))
    assert base.tolist() == pytest.approx([0.3, 0.5, 0.9])
    assert std.tolist() == [0.0, 0.0, 0.0]
    _, std_same = calculate_baseline_and_std_per_prompt(T([[1]] * 4), T([2.0] * 4), torch.ones(4))
    assert std_same.tolist() == [0.0] * 4


def test_baseline_groups_of_two_and_three_loo() -> None:
    base, std = calculate_baseline_and_std_per_prompt(_two_groups(2, 3), T([1.0, 2, 4, 5, 6]), torch.ones(5))
    assert base.tolist() == pytest.approx([2.0, 1.0, 5.5, 5.0, 4.5])
    assert std.tolist() == pytest.approx([0.0, 0.0, 0.7071, 1.4142, 0.7071], abs=1e-4)


def test_baseline_empty_input() -> None:
    base, std = calculate_baseline_and_std_per_prompt(torch.zeros(0, 3, dtype=torch.long), T([]), T([]))
    assert base.shape == (0,) and std.shape == (0,)


def test_baseline_invalid_row_loo_quirk() -> None:
    rewards = T([1.0, 999.0, 3.0, 4.0, 5.0, 6.0])
    valid = T([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    base, std = calculate_baseline_and_std_per_prompt(_two_groups(3, 3), rewards, valid)
    assert base.tolist() == pytest.approx([3.0, 4.0, 1.0, 5.5, 5.0, 4.5])
    assert std.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.7071, 1.4142, 0.7071], abs=1e-4)


def test_baseline_uses_std_rewards_for_std_only() -> None:
    base, std = calculate_baseline_and_std_per_prompt(
        T([[0]] * 3), T([0.0, -0.2, -1.0]), torch.ones(3), leave_one_out_baseline=False, std_rewards=torch.zeros(3)
    )
    assert base.tolist() == pytest.approx([-0.4] * 3)
    assert std.tolist() == [0.0] * 3


def test_baseline_huge_and_tiny_magnitudes_stay_finite() -> None:
    for scale in (1e30, 1e-30):
        base, std = calculate_baseline_and_std_per_prompt(T([[0]] * 3), T([1.0, 2.0, 3.0]) * scale, torch.ones(3))
        assert torch.isfinite(base).all() and torch.isfinite(std).all()
        assert std[1].item() == pytest.approx(math.sqrt(2) * scale, rel=1e-4)


def _baseline_by_definition(groups: list[int], r: list[float], v: list[float], loo: bool) -> tuple[list, list]:
    """Row by row from the docstring's definition (plain Python floats)."""
    base, std = [], []
    for i, g in enumerate(groups):
        members = [j for j, h in enumerate(groups) if h == g]
        num_valid = sum(v[j] for j in members)
        if num_valid <= 1:
            base.append(r[i])
            std.append(0.0)
            continue
        pool = [j for j in members if not (loo and j == i)]
        k = num_valid - 1 if loo else num_valid
        mean = sum(r[j] * v[j] for j in pool) / k
        base.append(mean)
        m2 = sum(r[j] ** 2 * v[j] for j in pool) / k
        std.append(math.sqrt(max(0.0, (m2 - mean**2) * k / (k - 1))) if k > 1 else 0.0)
    return base, std


@pytest.mark.parametrize("loo", [True, False])
def test_baseline_matches_its_definition_on_random_groups(loo: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        groups = torch.randint(0, 5, (13,), generator=gen)
        rewards = torch.randn(13, generator=gen, dtype=torch.float64)
        valid = (torch.rand(13, generator=gen) > 0.25).double()
        base, std = calculate_baseline_and_std_per_prompt(groups[:, None], rewards, valid, leave_one_out_baseline=loo)
        want_base, want_std = _baseline_by_definition(groups.tolist(), rewards.tolist(), valid.tolist(), loo)
        assert base.tolist() == pytest.approx(want_base, rel=1e-9, abs=1e-12)
        assert std.tolist() == pytest.approx(want_std, rel=1e-7, abs=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_baseline_stays_on_cuda() -> None:
    base, std = calculate_baseline_and_std_per_prompt(
        T([[0], [0]], device="cuda"), T([1.0, 2.0], device="cuda"), torch.ones(2, device="cuda")
    )
    assert base.is_cuda and std.is_cuda


# ------------------------------------------------------------------------------------------------ metric reduction
def test_aggregate_train_metrics() -> None:
    inf = float("inf")
    out = aggregate_train_metrics(
        {
            "loss": [0.25, 0.5, T(0.25)],
            "probs_ratio_min": [0.9, inf, 0.8],
            "probs_ratio_max": [1.1, -inf, 1.3],
            "probs_ratio_clamped_min": [inf, inf],
            "probs_ratio_clamped_max": [-inf],
            "lr": [1e-3, 1e-3, 2e-3],
            "global_valid_toks": [T(40.0), T(40.0)],
            "num_valid_samples": [3.0, 4.0],
            "scalar": 7,
        }
    )
    assert out["loss"] == pytest.approx(1.0)
    assert out["probs_ratio_min"] == pytest.approx(0.8)
    assert out["probs_ratio_max"] == pytest.approx(1.3)
    assert out["probs_ratio_clamped_min"] == -1.0
    assert out["probs_ratio_clamped_max"] == -1.0
    assert out["lr"] == pytest.approx(4e-3 / 3)
    assert out["global_valid_toks"] == pytest.approx(40.0)
    assert out["num_valid_samples"] == pytest.approx(7.0)
    assert out["scalar"] == 7.0

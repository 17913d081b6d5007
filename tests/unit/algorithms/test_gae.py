"""GAE: hand-computed recursions, masking / carry-forward, KL in the reward, decoupled and length-adaptive lambda,
whitening, and parity with a plain per-row reverse Python loop on random data."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.gae import (
    GeneralizedAdvantageEstimator,
    compute_gae,
    last_valid_positions,
    length_adaptive_lambda,
    whiten,
)

T = torch.tensor
PROMPTS = T([[0], [0]])


def _gae(**kw: object) -> GeneralizedAdvantageEstimator:
    base: dict[str, object] = {"gamma": 1.0, "lam": 1.0, "normalize_advantages": False}
    base.update(kw)
    return GeneralizedAdvantageEstimator(**base)  # type: ignore[arg-type]


def _reference_gae(
    rewards: list[float],
    values: list[list[float]],
    mask: list[list[int]],
    gamma: float,
    lams: list[float],
    token_rewards: list[list[float]] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Straightforward per-row loop: walk only the valid positions backwards, skipping masked ones."""
    advs, rets = [], []
    for i, row_v in enumerate(values):
        s = len(row_v)
        valid = [t for t in range(s) if mask[i][t]]
        rho = [0.0] * s
        for t in valid:
            rho[t] = token_rewards[i][t] if token_rewards is not None else 0.0
        if valid:
            rho[valid[-1]] += rewards[i]
        adv = [0.0] * s
        next_v, a = 0.0, 0.0
        for t in reversed(valid):
            a = rho[t] + gamma * next_v - row_v[t] + gamma * lams[i] * a
            next_v = row_v[t]
            adv[t] = a
        advs.append(adv)
        rets.append([adv[t] + row_v[t] for t in range(s)])
    return advs, rets


# ------------------------------------------------------------------------------------------------ compute_gae
def test_gamma_lambda_one_gives_reward_to_go() -> None:
    values = T([[0.2, 0.5, -0.3, 0.7]])
    adv, ret = compute_gae(T([2.0]), values, torch.ones(1, 4), gamma=1.0, lam=1.0)
    assert ret[0].tolist() == pytest.approx([2.0, 2.0, 2.0, 2.0], abs=1e-6)
    assert adv[0].tolist() == pytest.approx([1.8, 1.5, 2.3, 1.3], abs=1e-6)
    assert torch.allclose(ret, adv + values)


def test_lambda_zero_is_one_step_td() -> None:
    adv, ret = compute_gae(T([5.0]), T([[1.0, 2.0, 3.0]]), torch.ones(1, 3), gamma=1.0, lam=0.0)
    assert adv[0].tolist() == pytest.approx([1.0, 1.0, 2.0])
    assert ret[0].tolist() == pytest.approx([2.0, 3.0, 5.0])


def test_hand_computed_discounted_case() -> None:
    # t=2: d=1 -> A=1; t=1: d=0.9*0-1=-1 -> A=-1+0.45*1=-0.55; t=0: d=0.9*1-0.5=0.4 -> A=0.4+0.45*(-0.55)=0.1525
    adv, ret = compute_gae(T([1.0]), T([[0.5, 1.0, 0.0]]), torch.ones(1, 3), gamma=0.9, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.1525, -0.55, 1.0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.6525, 0.45, 1.0], abs=1e-6)


def test_masked_prompt_and_tail_positions_get_zero_advantage() -> None:
    values = T([[9.0, 1.0, 2.0, 3.0, 7.0, 7.0]])
    mask = T([[0, 1, 1, 1, 0, 0]])
    adv, ret = compute_gae(T([5.0]), values, mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.0, 4.0, 3.0, 2.0, 0.0, 0.0])
    assert ret[0, 1:4].tolist() == pytest.approx([5.0, 5.0, 5.0])
    assert torch.equal(ret, adv + values)


def test_row_without_valid_tokens_is_all_zero() -> None:
    values = T([[1.0, 2.0], [0.5, 0.5]])
    adv, ret = compute_gae(T([3.0, 4.0]), values, T([[0, 0], [1, 1]]), gamma=1.0, lam=1.0)
    assert adv[0].tolist() == [0.0, 0.0]
    assert adv[1].tolist() == pytest.approx([3.5, 3.5])
    assert torch.equal(ret[0], values[0])


def test_interior_gap_carries_forward() -> None:
    gap_free, _ = compute_gae(T([1.0]), T([[0.1, 0.4, 0.2, 0.6]]), torch.ones(1, 4), gamma=0.99, lam=0.95)
    with_gap, _ = compute_gae(T([1.0]), T([[0.1, 0.4, 999.0, 0.2, 0.6]]), T([[1, 1, 0, 1, 1]]), gamma=0.99, lam=0.95)
    assert with_gap[0, [0, 1, 3, 4]].tolist() == pytest.approx(gap_free[0].tolist(), abs=1e-6)
    assert with_gap[0, 2].item() == 0.0
    # and the gap-free values themselves are hand-checkable at the last token: 1 - 0.6
    assert gap_free[0, 3].item() == pytest.approx(0.4)


def test_token_rewards_and_per_row_lambda() -> None:
    # lam per row: row 0 lam=0 (one-step TD), row 1 lam=1 (reward-to-go); token reward -0.5 on each valid token.
    values = T([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rho = torch.full((2, 3), -0.5)
    adv, _ = compute_gae(T([5.0, 5.0]), values, torch.ones(2, 3), 1.0, T([0.0, 1.0]), token_rewards=rho)
    assert adv[0].tolist() == pytest.approx([0.5, 0.5, 1.5])  # [-.5+2-1, -.5+3-2, 4.5-3]
    assert adv[1].tolist() == pytest.approx([2.5, 2.0, 1.5])  # reward-to-go 3.5, 4.0, 4.5 minus V


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_reverse_python_loop_on_random_data(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, s = 5, 9
    values = torch.randn(b, s, generator=g, dtype=torch.float64)
    rewards = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, s, generator=g) > 0.35).long()
    mask[seed % b] = 0  # one row without any valid token
    token_rewards = 0.1 * torch.randn(b, s, generator=g, dtype=torch.float64)
    lams = torch.rand(b, generator=g, dtype=torch.float64)
    gamma = 0.97
    for lam, rho in ((0.9, None), (lams, token_rewards)):
        adv, ret = compute_gae(rewards, values, mask, gamma, lam, token_rewards=rho)
        lam_list = lams.tolist() if isinstance(lam, torch.Tensor) else [lam] * b
        exp_adv, exp_ret = _reference_gae(
            rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam_list, None if rho is None else rho.tolist()
        )
        assert torch.allclose(adv, T(exp_adv, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(ret, T(exp_ret, dtype=torch.float64), atol=1e-12)


def test_last_valid_positions() -> None:
    assert last_valid_positions(T([[1, 1, 0], [0, 0, 0], [0, 1, 1], [1, 0, 1]])).tolist() == [1, -1, 2, 2]


# ------------------------------------------------------------------------------------------------ whiten / lambda
def test_whiten_uses_unbiased_variance_and_zeroes_masked() -> None:
    out = whiten(T([[1.0, 2.0, 3.0, 50.0]]), T([[1, 1, 1, 0]]))
    # mean 2, unbiased var ((1 + 0 + 1) / 3) * 3 / 2 = 1
    assert out[0].tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)


def test_length_adaptive_lambda() -> None:
    mask = torch.zeros(2, 10)
    mask[0, :3] = 1
    mask[1, :8] = 1
    lam = length_adaptive_lambda(mask, 0.05)
    assert lam.shape == (2,)
    assert ((lam >= 0) & (lam <= 1)).all()
    assert lam.tolist() == [0.0, 0.0]  # alpha * len < 1 -> clamp to 1 -> lambda 0
    mask4 = torch.zeros(2, 10)
    mask4[0, :4] = 1
    mask4[1, :8] = 1
    assert length_adaptive_lambda(mask4, 0.5).tolist() == pytest.approx([0.5, 0.75])


# ------------------------------------------------------------------------------------------------ estimator
def test_estimator_normalize_gives_zero_mean_unit_std() -> None:
    g = torch.Generator().manual_seed(7)
    values = torch.randn(4, 12, generator=g)
    mask = torch.ones(4, 12)
    mask[:, :3] = 0
    mask[1, 9:] = 0
    rewards = torch.randn(4, generator=g)
    adv, ret = _gae(gamma=0.99, lam=0.95, normalize_advantages=True).compute_advantage(PROMPTS, rewards, mask, values)
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-5
    assert valid.std().item() == pytest.approx(1.0, abs=1e-4)
    assert adv[~mask.bool()].abs().max().item() == 0.0
    raw, raw_ret = compute_gae(rewards, values, mask, 0.99, 0.95)
    assert torch.equal(ret, raw_ret)  # returns (critic targets) are never whitened
    assert torch.allclose(valid, whiten(raw, mask)[mask.bool()])
    assert not torch.allclose(valid, raw[mask.bool()])


def test_estimator_default_equals_compute_gae() -> None:
    values, mask, rewards = T([[0.5, 1.0, 0.0, 3.0]]), T([[1, 1, 1, 0]]), T([1.0])
    adv, ret = _gae(gamma=0.9, lam=0.5).compute_advantage(T([[0]]), rewards, mask, values)
    assert adv[0, :3].tolist() == pytest.approx([0.1525, -0.55, 1.0], abs=1e-6)
    assert adv[0, 3].item() == 0.0
    assert ret[0, :3].tolist() == pytest.approx([0.6525, 0.45, 1.0], abs=1e-6)


def test_kl_in_reward() -> None:
    values, mask, rewards = torch.zeros(1, 3), torch.ones(1, 3), T([1.0])
    lp = T([[-1.0, -1.0, -1.0]])
    base, _ = _gae().compute_advantage(T([[0]]), rewards, mask, values)
    kl_on = _gae(use_kl_in_reward=True, kl_coef=0.1, kl_type="k3")
    same, _ = kl_on.compute_advantage(T([[0]]), rewards, mask, values, lp, lp.clone())
    assert torch.equal(same, base)
    # k3 with log(pi_ref / pi) = 1: e - 2 = 0.718282 per token; beta 0.1 -> -0.0718282 per token, summed to go.
    diff, _ = kl_on.compute_advantage(T([[0]]), rewards, mask, values, lp, torch.zeros(1, 3))
    k = 0.1 * (torch.e - 2)
    assert diff[0].tolist() == pytest.approx([1 - 3 * k, 1 - 2 * k, 1 - k], abs=1e-6)
    off, _ = _gae(use_kl_in_reward=False, kl_coef=0.1).compute_advantage(
        T([[0]]), rewards, mask, values, lp, torch.zeros(1, 3)
    )
    assert torch.equal(off, base)
    # KL at masked positions is dropped (the prompt token here).
    masked, _ = kl_on.compute_advantage(T([[0]]), rewards, T([[0, 1, 1]]), values, lp, torch.zeros(1, 3))
    assert masked[0].tolist() == pytest.approx([0.0, 1 - 2 * k, 1 - k], abs=1e-6)


def test_decoupled_lambda() -> None:
    values = T([[0.5, 1.0, 0.0, 0.3]])
    mask, rewards = T([[1, 1, 1, 0]]), T([1.0])
    adv, ret = _gae(gamma=0.9, lam=0.95, lam_value=1.0, lam_policy=0.5).compute_advantage(
        T([[0]]), rewards, mask, values
    )
    exp_adv, _ = compute_gae(rewards, values, mask, 0.9, 0.5)
    _, exp_ret = compute_gae(rewards, values, mask, 0.9, 1.0)
    assert torch.allclose(adv, exp_adv) and torch.allclose(ret, exp_ret)
    assert adv[0, :3].tolist() == pytest.approx([0.1525, -0.55, 1.0], abs=1e-6)
    assert ret[0, :3].tolist() == pytest.approx([0.81, 0.9, 1.0], abs=1e-6)  # discounted reward-to-go
    assert not torch.allclose(ret[mask.bool()], (adv + values)[mask.bool()])


def test_decoupled_lambda_zero_is_not_treated_as_unset() -> None:
    values, mask, rewards = T([[1.0, 2.0, 3.0]]), torch.ones(1, 3), T([5.0])
    _, ret = _gae(lam=1.0, lam_value=0.0).compute_advantage(T([[0]]), rewards, mask, values)
    assert ret[0].tolist() == pytest.approx([2.0, 3.0, 5.0])  # one-step TD targets, not reward-to-go


def test_length_adaptive_estimator_uses_per_row_lambda() -> None:
    values = T([[0.2, 0.4, 0.1, 0.3], [0.5, 0.1, 0.7, 0.2]])
    mask = T([[1, 1, 0, 0], [1, 1, 1, 1]])
    est = _gae(gamma=0.95, lam=0.9, length_adaptive_alpha=0.5)
    adv, ret = est.compute_advantage(PROMPTS, T([1.0, -1.0]), mask, values)
    lam = est.policy_lambda(mask)
    assert lam.tolist() == pytest.approx([0.0, 0.5])  # type: ignore[union-attr]
    for row, row_lam in enumerate((0.0, 0.5)):
        exp_adv, _ = compute_gae(T([1.0, -1.0]), values, mask, 0.95, row_lam)
        assert torch.allclose(adv[row], exp_adv[row])
    _, exp_ret = compute_gae(T([1.0, -1.0]), values, mask, 0.95, 0.9)
    assert torch.allclose(ret, exp_ret)


def test_invalid_lambda_rejected() -> None:
    with pytest.raises(ValueError):
        _gae(lam=1.5)
    with pytest.raises(ValueError):
        _gae(lam_policy=-0.1)

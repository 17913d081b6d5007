"""ClippedPGLossFn (PPO/GRPO, REINFORCE, CISPO, GSPO, dual clip, KL, truncated IS) and NLLLossFn.

Unless stated otherwise: B=1, S=4, token_mask [0,1,1,1]; values listed are for the 3 loss positions. With
prev = [-1,-1,-1], curr = [ln .5 - 1, -1, ln 1.5 - 1] gives ratios [0.5, 1, 1.5]; A = [1, -1, 2]; clip 0.2 / 0.2.
"""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.interfaces import LossType, MetricNormalizer
from relayrl.algorithms.loss_functions import ClippedPGLossFn, NLLLossFn
from tests.unit.algorithms.loss_cases import (
    ADV,
    CURR,
    PREV,
    T,
    cfg,
    counts,
    gspo_loss,
    make_data,
    run,
    seq_mask_tis_loss,
)

EXPECTED_KEYS = {
    "loss",
    "probs_ratio",
    "probs_ratio_clamped",
    "probs_ratio_min",
    "probs_ratio_max",
    "probs_ratio_clamped_min",
    "probs_ratio_clamped_max",
    "kl_penalty",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "sampling_importance_ratio",
    "num_valid_samples",
    "approx_entropy",
    "positive_nll_loss",
}


# ------------------------------------------------------------------------------------------------ PPO family
def test_ppo_clipping() -> None:
    loss, m = run(ClippedPGLossFn(cfg()), CURR, make_data(ADV, PREV))
    # max(-A r, -A clip(r)) = [-0.5, 1.0, -2.4]
    assert loss.item() == pytest.approx(-1.9 / 3, abs=1e-4)
    assert set(m) == EXPECTED_KEYS
    assert m["probs_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert m["probs_ratio_clamped"] == pytest.approx(1.0, abs=1e-5)
    assert (m["probs_ratio_min"], m["probs_ratio_max"]) == pytest.approx((0.5, 1.5), abs=1e-5)
    assert (m["probs_ratio_clamped_min"], m["probs_ratio_clamped_max"]) == pytest.approx((0.8, 1.2), abs=1e-5)
    assert m["num_valid_samples"] == 1.0 and m["kl_penalty"] == 0.0 and m["positive_nll_loss"] == 0.0
    assert m["token_mult_prob_error"] == pytest.approx(1.0) and m["sampling_importance_ratio"] == pytest.approx(1.0)


def test_clip_higher_asymmetric_bounds() -> None:
    loss, m = run(ClippedPGLossFn(cfg(ratio_clip_min=0.1, ratio_clip_max=0.3)), CURR, make_data(ADV, PREV))
    # -A r = [-0.5, 1, -3], -A clip(r, 0.9, 1.3) = [-0.9, 1, -2.6] -> max [-0.5, 1, -2.6]
    assert loss.item() == pytest.approx(-2.1 / 3, abs=1e-4)
    assert (m["probs_ratio_clamped_min"], m["probs_ratio_clamped_max"]) == pytest.approx((0.9, 1.3), abs=1e-5)


def test_reinforce_disable_ppo_ratio() -> None:
    curr = [-0.5, -1.0, -1.5]
    loss, m = run(ClippedPGLossFn(cfg(disable_ppo_ratio=True)), curr, make_data(ADV, PREV))
    assert loss.item() == pytest.approx(2.5 / 3, abs=1e-4)  # -A * curr = [0.5, -1, 3]
    assert (m["probs_ratio_min"], m["probs_ratio_max"]) == pytest.approx((-1.5, -0.5))  # log-probs, reference quirk


def test_force_on_policy_ratio() -> None:
    loss, m = run(ClippedPGLossFn(cfg(force_on_policy_ratio=True)), CURR, make_data(ADV, PREV))
    assert loss.item() == pytest.approx(-2 / 3, abs=1e-4)
    for key in ("probs_ratio", "probs_ratio_clamped"):
        assert m[key] == pytest.approx(1.0, abs=1e-7)
    for key in ("probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max"):
        assert m[key] == 1.0


def test_force_on_policy_ignores_prev_logprobs() -> None:
    fn = ClippedPGLossFn(cfg(force_on_policy_ratio=True))
    loss_a, m_a, c_a = run(fn, CURR, make_data(ADV, CURR), grad=True)
    loss_b, m_b, c_b = run(fn, CURR, make_data(ADV, [-10.0] * 3), grad=True)
    assert loss_a.item() == loss_b.item() and m_b["probs_ratio"] == pytest.approx(1.0)
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(c_a.grad, c_b.grad)
    assert c_a.grad[0].tolist() == pytest.approx([-1 / 3, 1 / 3, -2 / 3])  # d(-A * r)/dc with r == 1


def test_dual_clip() -> None:
    prev = [-1.0, -1.0, -3.0]
    curr = [math.log(0.5) - 1, -1.0, math.log(10.0) - 3]  # ratios [0.5, 1, 10]
    loss, _ = run(ClippedPGLossFn(cfg(ratio_clip_c=3.0)), curr, make_data([1.0, -1.0, -4.0], prev))
    assert loss.item() == pytest.approx(12.5 / 3, abs=1e-4)  # [-0.5, 1.0, 12.0]


def test_approx_entropy() -> None:
    curr = [-0.5, -1.0, -1.5]
    _, m = run(ClippedPGLossFn(cfg()), curr, make_data(ADV, PREV, gen=[-0.6, -1.1, -1.6]))
    assert m["approx_entropy"] == pytest.approx(math.exp(0.1) * 3 / 3, abs=1e-4)  # 1.1052


def test_mismatch_diagnostics() -> None:
    gen = [-1.5, -1.0, -0.5]  # |gen - prev| = [0.5, 0, 0.5]
    _, m = run(ClippedPGLossFn(cfg(reference_policy_kl_type="k1")), CURR, make_data(ADV, PREV, gen=gen))
    assert m["token_mult_prob_error"] == pytest.approx((2 * math.exp(0.5) + 1) / 3, abs=1e-5)
    # k1(g, ref=p) = g - p = [-0.5, 0, 0.5] -> mean 0; same for the reverse direction
    assert m["gen_kl_error"] == pytest.approx(0.0, abs=1e-6) and m["policy_kl_error"] == pytest.approx(0.0, abs=1e-6)
    p, g = -1.0, -1.5
    lm = math.log(0.5 * math.exp(p) + 0.5 * math.exp(g))
    js = 0.5 * (math.exp(p - lm) - (p - lm) - 1) + 0.5 * (math.exp(g - lm) - (g - lm) - 1)
    p2, g2 = -1.0, -0.5
    lm2 = math.log(0.5 * math.exp(p2) + 0.5 * math.exp(g2))
    js2 = 0.5 * (math.exp(p2 - lm2) - (p2 - lm2) - 1) + 0.5 * (math.exp(g2 - lm2) - (g2 - lm2) - 1)
    assert m["js_divergence_error"] == pytest.approx((js + js2) / 3, abs=1e-6)


# ------------------------------------------------------------------------------------------------ CISPO
@pytest.mark.parametrize(
    "bad",
    [
        {"disable_ppo_ratio": True},
        {"force_on_policy_ratio": True},
        {"ratio_clip_c": 3.0},
        {"sequence_level_importance_ratios": True, "token_level_loss": False},
    ],
)
def test_cispo_rejects_incompatible_flags(bad: dict) -> None:
    with pytest.raises(ValueError, match="use_cispo"):
        ClippedPGLossFn(cfg(use_cispo=True, **bad))


def test_cispo_loss_and_gradient() -> None:
    loss, _, c = run(ClippedPGLossFn(cfg(use_cispo=True)), CURR, make_data(ADV, PREV), grad=True)
    assert loss.item() == pytest.approx(0.5938, abs=1e-4)  # mean(-A * clip(r) * curr)
    loss.backward()
    # the clipped ratio is a constant: d/dc = -A * clip(r) / 3
    assert c.grad[0].tolist() == pytest.approx([-0.8 / 3, 1 / 3, -2.4 / 3], abs=1e-6)


def test_cispo_with_importance_sampling() -> None:
    fn = ClippedPGLossFn(cfg(use_cispo=True, use_importance_sampling_correction=True))
    loss, m = run(fn, CURR, make_data(ADV, PREV, gen=[-0.5, -1.5, -0.8]))
    assert loss.item() == pytest.approx(0.1137, abs=1e-4)
    w = [math.exp(-0.5), math.exp(0.5), math.exp(-0.2)]
    assert m["sampling_importance_ratio"] == pytest.approx(sum(w) / 3, abs=1e-5)


# ------------------------------------------------------------------------------------------------ KL penalty
def test_kl_penalty_value() -> None:
    fn = ClippedPGLossFn(cfg(reference_policy_kl_penalty=0.1))
    loss, m = run(fn, [0.0, -1.0, -2.0], make_data([0.0] * 3, [0.0] * 3, ref=[-1.0] * 3))
    k3 = [math.exp(-1), 0.0, math.e - 2]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 3, abs=1e-5)  # 0.03621
    assert m["kl_penalty"] == pytest.approx(sum(k3) / 3, abs=1e-5)  # 0.3621


def test_kl_in_reward_disables_loss_kl() -> None:
    fn = ClippedPGLossFn(cfg(reference_policy_kl_penalty=0.1, use_kl_in_reward=True))
    loss, m = run(fn, [0.0, -1.0, -2.0], make_data([0.0] * 3, [0.0] * 3, ref=[-1.0] * 3))
    assert loss.item() == 0.0 and m["kl_penalty"] == 0.0


@pytest.mark.parametrize(
    ("on_policy", "expected"),
    [(False, [-0.045, 0.06]), (True, [-0.045 * math.exp(0.3), 0.06 * math.exp(-0.3)])],
)
def test_kl_gradient_includes_sampling_term(on_policy: bool, expected: list[float]) -> None:
    data = make_data([0.4, -0.2], [-1.0, -0.8], gen=[-1.5, -0.4], ref=[-0.9, -1.1])
    grads = []
    for beta in (0.3, 0.0):
        fn = ClippedPGLossFn(cfg(reference_policy_kl_penalty=beta, use_on_policy_kl_approximation=on_policy))
        loss, _, c = run(fn, [-1.2, -0.7], data, grad=True)
        loss.backward()
        grads.append(c.grad)
    assert (grads[0] - grads[1])[0].tolist() == pytest.approx(expected, abs=1e-5)


def test_kl_uses_unfiltered_curr_logprobs() -> None:
    fn = ClippedPGLossFn(cfg(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k1"))
    data = make_data([0.0] * 3, [0.0] * 3, ref=[0.0] * 3)
    data["curr_logprobs_unfiltered"] = T([[-0.3, -0.6, -0.9]])
    loss, m = run(fn, [0.0, 0.0, 0.0], data)
    assert loss.item() == pytest.approx(-0.6, abs=1e-6)  # mean(curr_u - ref)
    assert m["kl_penalty"] == pytest.approx(-0.6, abs=1e-6)


# ------------------------------------------------------------------------------------------------ masking
def test_masking_and_sample_mask_equivalence() -> None:
    g = torch.Generator().manual_seed(0)
    curr = (-torch.rand(2, 5, generator=g) * 2).tolist()
    data = make_data(
        torch.randn(2, 5, generator=g).tolist(),
        (-torch.rand(2, 5, generator=g) * 2).tolist(),
        gen=(-torch.rand(2, 5, generator=g) * 2).tolist(),
        ref=(-torch.rand(2, 5, generator=g) * 2).tolist(),
    )
    fn = ClippedPGLossFn(cfg(reference_policy_kl_penalty=0.1))
    base, _ = run(fn, curr, data)
    more = {**data, "token_mask": data["token_mask"].clone()}
    more["token_mask"][0, 3] = 0.0
    assert run(fn, curr, more)[0].item() != pytest.approx(base.item(), abs=1e-6)

    masked, _ = run(fn, curr, {**data, "sample_mask": T([1.0, 0.0])})
    row0 = {k: v[:1] for k, v in data.items()}
    alone, _ = run(fn, curr[:1], row0)
    assert masked.item() == pytest.approx(alone.item(), abs=1e-7)


def test_all_zero_token_mask_gives_zero_loss() -> None:
    fn = ClippedPGLossFn(cfg(reference_policy_kl_penalty=0.1))
    loss, m = run(fn, CURR, make_data(ADV, PREV, ref=[-2.0] * 3, token_mask=[0.0, 0.0, 0.0]))
    assert loss.item() == 0.0
    assert m["probs_ratio_min"] == float("inf") and m["probs_ratio_max"] == float("-inf")


def test_first_position_is_never_trained() -> None:
    data = make_data(ADV, PREV)
    data["advantages"][0, 0] = 100.0
    data["token_mask"][0, 0] = 1.0  # even if the caller marks it
    assert run(ClippedPGLossFn(cfg()), CURR, data)[0].item() == pytest.approx(-1.9 / 3, abs=1e-4)


def test_token_vs_sequence_level_aggregation() -> None:
    # row 0: one valid token with A = 3; row 1: three tokens with A = 1; force_on_policy -> pg = -A
    data = make_data([[3.0, 0.0, 0.0], [1.0, 1.0, 1.0]], [[0.0] * 3] * 2, token_mask=[[1.0, 0, 0], [1.0, 1, 1]])
    curr = [[-1.0] * 3] * 2
    tok, _ = run(ClippedPGLossFn(cfg(force_on_policy_ratio=True)), curr, data)
    seq_fn = ClippedPGLossFn(cfg(force_on_policy_ratio=True, token_level_loss=False))
    seq, _ = run(seq_fn, curr, data)
    assert tok.item() == pytest.approx(-6 / 4) and seq.item() == pytest.approx(-2.0)
    assert seq_fn.loss_type == LossType.SEQUENCE_LEVEL


# ------------------------------------------------------------------------------------------------ VAPO NLL
def test_positive_example_nll() -> None:
    fn = ClippedPGLossFn(cfg(force_on_policy_ratio=True, positive_example_nll_weight=0.5))
    data = make_data([[0.0] * 3] * 2, [[0.0] * 3] * 2)
    data["rewards"] = T([1.0, 0.0])
    loss, m = run(fn, [[-1.0, -2.0, -3.0], [-9.0] * 3], data)
    assert m["positive_nll_loss"] == pytest.approx(2.0)  # local mean over the rewarded row only
    assert loss.item() == pytest.approx(1.0)
    del data["rewards"]
    assert run(fn, [[-1.0, -2.0, -3.0], [-9.0] * 3], data)[0].item() == 0.0


# ------------------------------------------------------------------------------------------------ normalisation
def test_metric_normalizers() -> None:
    tok, seq, none = MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES, MetricNormalizer.NONE
    default = ClippedPGLossFn(cfg()).metric_normalizations
    assert default["loss"] == default["kl_penalty"] == default["sampling_importance_ratio"] == tok
    assert all(default[k] == tok for k in ("probs_ratio", "token_mult_prob_error", "js_divergence_error"))
    assert all(default[k] == none for k in ("num_valid_samples", "probs_ratio_min", "positive_nll_loss"))
    assert "is_oob_ratio" not in default
    assert set(default) == EXPECTED_KEYS
    gspo = gspo_loss().metric_normalizations
    assert gspo["loss"] == gspo["kl_penalty"] == gspo["sampling_importance_ratio"] == seq
    assert gspo["approx_entropy"] == gspo["gen_kl_error"] == tok
    smt = seq_mask_tis_loss().metric_normalizations
    assert smt["loss"] == tok and smt["is_oob_ratio"] == seq
    tis_seq = ClippedPGLossFn(
        cfg(
            token_level_loss=False,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=2.0,
        )
    ).metric_normalizations
    assert tis_seq["loss"] == seq and tis_seq["is_oob_ratio"] == tok
    nll = NLLLossFn().metric_normalizations
    assert nll["loss"] == tok and nll["num_unmasked_tokens"] == nll["num_valid_samples"] == none


def _random_batch(b: int = 4, s: int = 8, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(b, s, generator=g) * 2
    data = {
        "token_mask": torch.ones(b, s),
        "sample_mask": T([1.0, 1.0, 0.0, 1.0][:b]),
        "advantages": torch.randn(b, s, generator=g),
        "prev_logprobs": prev,
        "generation_logprobs": prev + torch.randn(b, s, generator=g) * 0.2,
        "reference_policy_logprobs": -torch.rand(b, s, generator=g) * 2,
    }
    data["token_mask"][:, 0] = 0.0
    data["token_mask"][0, 5:] = 0.0
    data["token_mask"][3, 2] = 0.0
    curr = prev[:, 1:] + torch.randn(b, s - 1, generator=g) * 0.3
    return curr, data


SPLIT_CONFIGS = [
    {"reference_policy_kl_penalty": 0.1},
    {"reference_policy_kl_penalty": 0.1, "token_level_loss": False},
    {"sequence_level_importance_ratios": True, "token_level_loss": False, "use_importance_sampling_correction": True},
    {
        "reference_policy_kl_penalty": 0.05,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.5,
        "truncated_importance_sampling_ratio_min": 0.7,
    },
]


@pytest.mark.parametrize("kw", SPLIT_CONFIGS)
def test_micro_batch_sum_equals_full_batch(kw: dict) -> None:
    curr, data = _random_batch()
    fn = ClippedPGLossFn(cfg(**kw))
    n_s, n_t = counts(data)
    c_full = curr.clone().requires_grad_(True)
    full, full_m = fn(c_full, data, n_s, n_t)
    full.backward()
    c_mb = curr.clone().requires_grad_(True)
    total = torch.zeros(())
    summed: dict[str, float] = {}
    for rows in (slice(0, 2), slice(2, 4)):
        loss, m = fn(c_mb[rows], {k: v[rows] for k, v in data.items()}, n_s, n_t)
        total = total + loss
        for k, v in m.items():
            summed[k] = summed.get(k, 0.0) + v
    total.backward()
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(c_mb.grad, c_full.grad, atol=1e-7)
    for key, norm in fn.metric_normalizations.items():
        if norm != MetricNormalizer.NONE:
            assert summed[key] == pytest.approx(full_m[key], abs=1e-6), key
    assert summed["num_valid_samples"] == full_m["num_valid_samples"] == 3.0


def test_split_rescale_parity_with_placeholder_counts() -> None:
    curr, data = _random_batch()
    fn = ClippedPGLossFn(cfg(**SPLIT_CONFIGS[3]))
    n_s, n_t = counts(data)
    one = torch.tensor(1.0)
    true_sum: dict[str, float] = {}
    rescaled_sum: dict[str, float] = {}
    for rows in (slice(0, 2), slice(2, 4)):
        mb = {k: v[rows] for k, v in data.items()}
        _, m_true = fn(curr[rows], mb, n_s, n_t)
        _, m_one = fn(curr[rows], mb, one, one)
        for key, norm in fn.metric_normalizations.items():
            if key.endswith(("_min", "_max")):
                continue
            denom = {MetricNormalizer.TOKENS: n_t, MetricNormalizer.SEQUENCES: n_s}.get(norm, one).item()
            true_sum[key] = true_sum.get(key, 0.0) + m_true[key]
            rescaled_sum[key] = rescaled_sum.get(key, 0.0) + m_one[key] / denom
    assert "is_oob_ratio" in true_sum
    for key, value in true_sum.items():
        assert rescaled_sum[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert true_sum["num_valid_samples"] == 3.0


# ------------------------------------------------------------------------------------------------ NLL
def _nll_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def test_nll_loss() -> None:
    input_ids = T([[0, 1, 2, 3]])
    data = {"token_mask": T([[0.0, 0.0, 1.0, 1.0]]), "sample_mask": T([1.0])}
    perfect = torch.zeros(1, 4, 5)
    perfect[0, torch.arange(3), input_ids[0, 1:]] = 999.0
    fn = NLLLossFn()
    loss, m = fn(_nll_logprobs(perfect, input_ids), data, T(1.0), T(2.0))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert m["num_unmasked_tokens"] == 2.0 and m["num_valid_samples"] == 1.0
    wrong = torch.zeros(1, 4, 5)
    wrong[0, :, 4] = 999.0  # all mass on a token that is never the target
    loss, m = fn(_nll_logprobs(wrong, input_ids), data, T(1.0), T(2.0))
    assert loss.item() == pytest.approx(999.0, rel=1e-5)
    assert fn.loss_type == LossType.TOKEN_LEVEL

"""ClippedPGLossFn's importance-sampling corrections (on-policy KL approximation, truncated IS: tis, icepop,
seq-mask-tis) and GSPO's sequence-level ratios. Cases as in loss_cases.py."""

from __future__ import annotations

import math

import pytest

from relayrl.algorithms.loss_functions import ClippedPGLossFn
from tests.unit.algorithms.loss_cases import ADV, CURR, PREV, cfg, gspo_loss, make_data, run, seq_mask_tis_loss


# ------------------------------------------------------------------------------------------------ importance sampling
def test_on_policy_kl_approximation_with_is_correction() -> None:
    fn = ClippedPGLossFn(cfg(use_on_policy_kl_approximation=True, use_importance_sampling_correction=True))
    loss, _ = run(fn, CURR, make_data(ADV, PREV, gen=[-0.5, -1.5, -0.8]))
    w = [math.exp(-0.5), math.exp(0.5), math.exp(-0.2)]
    assert loss.item() == pytest.approx((w[0] * -0.5 + w[1] * 1.0 + w[2] * -2.4) / 3, abs=1e-4)  # -0.2065


def test_truncated_is_tis() -> None:
    fn = ClippedPGLossFn(
        cfg(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=0.8,
        )
    )
    loss, m = run(fn, CURR, make_data(ADV, PREV, gen=[-0.5, -1.5, -0.8]))
    assert loss.item() == pytest.approx((math.exp(-0.5) * -0.5 + 0.8 * 1.0 + 0.8 * -2.4) / 3, abs=1e-4)  # -0.4744
    assert m["is_oob_ratio"] == pytest.approx(2 / 3)


def test_truncated_is_tisgspo_loss() -> None:
    fn = ClippedPGLossFn(
        cfg(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=0.8,
            sequence_level_importance_ratios=True,
            token_level_loss=False,
        )
    )
    loss, m = run(fn, CURR, make_data(ADV, PREV, gen=[-0.5, -1.5, -0.8]))
    assert loss.item() == pytest.approx(-0.4846, abs=1e-4)
    assert m["sampling_importance_ratio"] == pytest.approx(0.8, abs=1e-6)


def test_icepop_zeroes_out_of_range_tokens() -> None:
    fn = ClippedPGLossFn(
        cfg(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio=5.0,
            truncated_importance_sampling_ratio_min=0.5,
        )
    )
    loss, m = run(fn, PREV, make_data(ADV, PREV, gen=[-0.5, -3.5, -0.8]))
    assert loss.item() == pytest.approx((math.exp(-0.5) * -1 + math.exp(-0.2) * -2) / 3, abs=1e-4)  # -0.7480
    assert m["is_oob_ratio"] == pytest.approx(1 / 3)


def test_is_oob_ratio_tis() -> None:
    fn = ClippedPGLossFn(
        cfg(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=2.0,
        )
    )
    prev = [0.0, math.log(3.0), math.log(0.5)]
    _, m = run(fn, prev, make_data(ADV, prev, gen=[0.0] * 3))
    assert m["is_oob_ratio"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_tis_min_above_max_rejected(kind: str) -> None:
    with pytest.raises(ValueError, match="truncated_importance_sampling_ratio_min must be <= truncated_importance"):
        ClippedPGLossFn(
            cfg(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type=kind,
                truncated_importance_sampling_ratio=1.0,
                truncated_importance_sampling_ratio_min=2.0,
            )
        )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}, "use_importance"),
        ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis"}, "positive"),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 2.0,
            },
            "ratio_min must be set",
        ),
        ({"sequence_level_importance_ratios": True}, "mutually exclusive with token-level loss"),
    ],
)
def test_construction_checks(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ClippedPGLossFn(cfg(**kw))


@pytest.mark.parametrize(("tis_min", "weights", "oob"), [(None, [0.1, 1.0, 2.0], 1 / 3), (0.5, [0.5, 1.0, 2.0], 2 / 3)])
def test_tis_min_default_zero(tis_min: float | None, weights: list[float], oob: float) -> None:
    fn = ClippedPGLossFn(
        cfg(
            force_on_policy_ratio=True,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=2.0,
            truncated_importance_sampling_ratio_min=tis_min,
        )
    )
    loss, m = run(fn, [math.log(0.1), 0.0, math.log(3.0)], make_data(ADV, [0.0] * 3, gen=[0.0] * 3))
    assert loss.item() == pytest.approx(sum(-a * w for a, w in zip(ADV, weights)) / 3, abs=1e-4)
    assert m["is_oob_ratio"] == pytest.approx(oob)


def test_seq_mask_tis_keeps_close_sequence() -> None:
    gen = [p - 0.0005 for p in PREV]
    loss, m = run(seq_mask_tis_loss(), PREV, make_data(ADV, PREV, gen=gen))
    assert loss.item() == pytest.approx(math.exp(0.0005) * -2 / 3, abs=1e-6)
    assert m["is_oob_ratio"] == 0.0


def test_seq_mask_tis_drops_far_sequence_and_survives_neg_inf() -> None:
    far, _ = run(seq_mask_tis_loss(), PREV, make_data(ADV, PREV, gen=[-1.1] * 3))
    assert far.item() == 0.0
    gen = [PREV[0] - 0.0005, float("-inf"), PREV[2] - 0.0005]
    loss, m = run(seq_mask_tis_loss(), PREV, make_data(ADV, PREV, gen=gen))
    assert math.isfinite(loss.item())
    # middle weight exp(+inf) -> 0; the sequence stays kept (geo-mean uses 0 there)
    assert loss.item() == pytest.approx(math.exp(0.0005) * (-1 - 2) / 3, abs=1e-6)
    assert m["is_oob_ratio"] == 0.0


# ------------------------------------------------------------------------------------------------ GSPO
def test_gspo_sequence_ratio() -> None:
    loss, m = run(gspo_loss(), CURR, make_data(ADV, PREV))
    r = math.exp((math.log(0.5) + math.log(1.5)) / 3)  # 0.9086
    assert loss.item() == pytest.approx(-r * 2 / 3, abs=1e-4)  # -0.6057
    assert m["probs_ratio_min"] == pytest.approx(r, abs=1e-5) and m["probs_ratio_max"] == pytest.approx(r, abs=1e-5)


def test_gspo_two_rows() -> None:
    loss, _ = run(gspo_loss(), [CURR, CURR], make_data([ADV, ADV], [PREV, [-2.0] * 3]))
    r1 = math.exp((math.log(0.5) + math.log(1.5)) / 3)
    r2 = math.exp(sum(c + 2 for c in CURR) / 3)  # 2.4697 -> clamped 1.2
    row1 = -r1 * 2 / 3
    row2 = (-1.2 + r2 - 2.4) / 3
    assert loss.item() == pytest.approx((row1 + row2) / 2, abs=1e-4)  # -0.4912


def test_gspo_with_is_correction() -> None:
    loss, _ = run(
        gspo_loss(use_importance_sampling_correction=True), CURR, make_data(ADV, PREV, gen=[-0.5, -1.5, -0.8])
    )
    assert loss.item() == pytest.approx(-0.6057 * math.exp(-0.2), abs=1e-4)  # -0.4959

"""Pieces of the data-plane PPO trainer: sharded GAE whitening and metrics equal the whole-batch estimator, the
logprob columns GAE reads, and the inputs the trainer refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relayrl.algorithms.gae import (
    GeneralizedAdvantageEstimator,
    RawRewardAdvantageEstimator,
    advantage_moments,
    advantage_value_metrics,
    combine_advantage_stats,
    shard_advantage_stats,
    whiten_with_moments,
    without_normalization,
)
from relayrl.algorithms.ppo_sync import _kl_logprob_fields, ppo_train_sync
from relayrl.config import MasterConfig


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])  # [B]
    values = torch.randn(6, 9, generator=g)  # [B, S]
    lengths = torch.tensor([9, 4, 7, 2, 8, 5])
    mask = ((torch.arange(9)[None, :] < lengths[:, None]) & (torch.arange(9)[None, :] >= 1)).float()  # [B, S]
    mask[3] = 0.0  # a filtered row
    return rewards, values, mask


@pytest.mark.parametrize("kind", ["gae", "raw_reward"])
def test_two_shard_whitening_equals_the_whole_batch(kind) -> None:
    rewards, values, mask = _batch()
    gae = GeneralizedAdvantageEstimator(gamma=1.0, lam=0.9, normalize_advantages=True)
    estimator = gae if kind == "gae" else RawRewardAdvantageEstimator(1.0, True, gae)
    expected, expected_returns = estimator.compute_advantage(torch.zeros(6, 1), rewards, mask, values)

    raw = without_normalization(estimator)
    assert raw.normalize_advantages is False and estimator.normalize_advantages is True  # a copy, not the original
    parts = []
    for rows in (slice(0, 2), slice(2, 6)):  # uneven shards, one holding the filtered row
        adv, ret = raw.compute_advantage(torch.zeros(1, 1), rewards[rows], mask[rows], values[rows])
        assert torch.equal(ret, expected_returns[rows])  # GAE is row-local
        parts.append((adv, mask[rows]))
    moments = sum(advantage_moments(a, m) for a, m in parts)  # [3]
    full_raw, _ = raw.compute_advantage(torch.zeros(6, 1), rewards, mask, values)
    assert torch.allclose(moments, advantage_moments(full_raw, mask))
    whitened = torch.cat([whiten_with_moments(a, m, moments, estimator) for a, m in parts])  # [B, S]
    assert torch.allclose(whitened * mask, expected * mask, atol=1e-6)
    valid = whitened[mask.bool()]
    assert abs(float(valid.mean())) < 1e-6 and float(valid.std(unbiased=kind == "gae")) == pytest.approx(1.0, 1e-4)


def test_shard_stats_combine_to_the_batch_metrics() -> None:
    rewards, values, mask = _batch(1)
    adv, ret = GeneralizedAdvantageEstimator(1.0, 0.95, True).compute_advantage(None, rewards, mask, values)
    whole = advantage_value_metrics(adv, ret, values, mask)
    assert combine_advantage_stats([shard_advantage_stats(adv, ret, values, mask)]) == whole  # one shard: as is
    shards = [shard_advantage_stats(adv[r], ret[r], values[r], mask[r]) for r in (slice(0, 3), slice(3, 6))]
    assert combine_advantage_stats([*shards, None]) == pytest.approx(whole, abs=1e-6)  # None: an idle rank


def test_kl_logprob_fields() -> None:
    cfg = MasterConfig.model_validate({"algorithm": "ppo"})
    assert _kl_logprob_fields(cfg, skip_ref=False) == ()  # KL as a loss term (or none): GAE reads no logprobs
    kl = cfg.model_copy(
        update={
            "loss_fn": cfg.loss_fn.model_copy(update={"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1})
        }
    )
    assert _kl_logprob_fields(kl, skip_ref=False) == ("prev_logprobs", "reference_policy_logprobs")
    assert _kl_logprob_fields(kl, skip_ref=True) == ("prev_logprobs",)  # the worker reads a skipped reference as zeros


def test_refuses_misconfigured_runs() -> None:
    cfg = MasterConfig.model_validate({"algorithm": "ppo", "data_plane": {"enabled": False}})
    args = [object()] * 13
    with pytest.raises(ValueError, match="data_plane.enabled=true"):
        ppo_train_sync(*args, cfg)
    on = MasterConfig.model_validate({"algorithm": "ppo", "data_plane": {"enabled": True}})
    policy, value = SimpleNamespace(tq_partition_id="train"), SimpleNamespace(tq_partition_id="critic")
    with pytest.raises(ValueError, match="must share one partition"):
        ppo_train_sync(policy, args[0], value, *args[3:], on)

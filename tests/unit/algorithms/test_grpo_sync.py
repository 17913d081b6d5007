"""Data-plane trainer helpers (issue 5): dynamic sampling on metadata, logprob-error metrics, penalty refusal."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.grpo_sync import (
    _apply_dynamic_sampling,
    _compute_seq_logprob_error_metrics,
    _raise_if_message_level_advantage_penalties_enabled,
    _train_fields_for_step,
)
from relayrl.algorithms.trainer_common import worker_seq_logprob_error_metrics
from relayrl.config import MasterConfig
from relayrl.data_plane.column_io import first_write
from relayrl.data_plane.interfaces import MissingKeysError
from relayrl.data_plane.memory import ColumnarStore, MemoryDataPlaneClient
from relayrl.data_plane.schema import DP_TRAIN_FIELDS
from relayrl.distributed.batched_data_dict import BatchedDataDict


class _StorePolicy:
    """The one policy method dynamic sampling uses, over a real in-process store."""

    def __init__(self, client: MemoryDataPlaneClient) -> None:
        self.client = client

    def discard_samples(self, sample_ids: list[str], partition_id: str) -> None:
        self.client.clear_samples(sample_ids, partition_id)


def _rollout(client: MemoryDataPlaneClient, n: int, stds: list[float], rewards: list[float], uid: str):
    bulk = {
        "input_ids": torch.arange(n * 8).view(n, 8),
        "input_lengths": torch.full((n,), 8),
        "token_mask": torch.ones(n, 8, dtype=torch.long),
    }
    meta = first_write(bulk, keys=[f"{uid}_g{i}" for i in range(n)], client=client, partition_id="train")
    meta.stamp_tags({"std": stds})
    carry = BatchedDataDict(total_reward=torch.tensor(rewards), text=[f"{uid}{i}" for i in range(n)])
    return meta, carry


@pytest.fixture()
def client():
    c = MemoryDataPlaneClient(ColumnarStore(storage_capacity=1000))
    c.register_partition("train", list(DP_TRAIN_FIELDS), 16, ["train"])
    yield c
    c.close()


def _ds(meta, carry, pending, n_gen, target=4, max_gen=10, policy=None):
    pm, pc, pr = pending
    return _apply_dynamic_sampling(
        meta=meta,
        driver_carry=carry,
        pending_meta=pm,
        pending_carry=pc,
        pending_unfiltered_rewards=pr,
        train_prompts_size=target,
        num_gen_batches=n_gen,
        max_gen_batches=max_gen,
        policy=policy,
    )


def test_incomplete_batch_drops_zero_std_keys_from_the_store(client):
    meta, carry = _rollout(client, 4, [0.5, 0.0, 0.5, 0.0], [1.0, 2.0, 3.0, 4.0], "a")
    pm, pc, pr, complete, metrics, unfiltered = _ds(meta, carry, (None, None, []), 1, policy=_StorePolicy(client))
    assert not complete and unfiltered is None and metrics == {"dynamic_sampling_num_gen_batches": 1}
    assert pm.keys == ["a_g0", "a_g2"] and pc["total_reward"].tolist() == [1.0, 3.0]
    assert pc["filtered_reward"].tolist() == [1.0, 3.0] and pc["text"] == ["a0", "a2"]
    with pytest.raises(MissingKeysError):
        client.get_samples(["a_g1"], "train", ["input_ids"])
    assert client.get_samples(["a_g0", "a_g2"], "train", ["input_ids"])["input_ids"].materialize().shape == (2, 8)

    # a second generation batch completes the step; unfiltered rewards cover both batches
    meta2, carry2 = _rollout(client, 4, [0.5, 0.5, 0.0, 0.0], [5.0, 6.0, 7.0, 8.0], "b")
    pm, pc, pr, complete, metrics, unfiltered = _ds(meta2, carry2, (pm, pc, pr), 2, policy=_StorePolicy(client))
    assert complete and pr == [] and pm.keys == ["a_g0", "a_g2", "b_g0", "b_g1"]
    assert pc["total_reward"].tolist() == [1.0, 3.0, 5.0, 6.0]
    assert unfiltered.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert metrics == {"dynamic_sampling_num_gen_batches": 2, "dynamic_sampling_num_discarded_valid_samples": 0}
    assert sorted(client.keys("train")) == sorted(pm.keys)  # nothing else left behind


def test_complete_batch_discards_extra_rows(client):
    meta, carry = _rollout(client, 6, [0.5] * 6, [float(i) for i in range(6)], "c")
    pm, pc, _, complete, metrics, unfiltered = _ds(meta, carry, (None, None, []), 1, policy=_StorePolicy(client))
    assert complete and pm.size == 4 and pc.size == 4
    assert metrics["dynamic_sampling_num_discarded_valid_samples"] == 2
    assert sorted(client.keys("train")) == ["c_g0", "c_g1", "c_g2", "c_g3"]
    assert unfiltered.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_raises_after_max_gen_batches_and_clears_the_cache(client):
    meta, carry = _rollout(client, 2, [0.0, 0.5], [0.0, 1.0], "d")
    with pytest.raises(ValueError, match="dynamic_sampling_max_gen_batches=10"):
        _ds(meta, carry, (None, None, []), 11, policy=_StorePolicy(client))
    assert client.keys("train") == []


def test_requires_std_tags(client):
    meta, carry = _rollout(client, 2, [0.5, 0.5], [0.0, 1.0], "e")
    meta.tags = None
    with pytest.raises(ValueError, match="std"):
        _ds(meta, carry, (None, None, []), 1, policy=_StorePolicy(client))


def test_penalty_refusal_names_the_keys():
    _raise_if_message_level_advantage_penalties_enabled(MasterConfig())
    cfg = MasterConfig.model_validate({"reward_penalties": {"invalid_tool_call_advantage": -5.0}})
    with pytest.raises(NotImplementedError, match=r"reward_penalties\.invalid_tool_call_advantage.*data_plane"):
        _raise_if_message_level_advantage_penalties_enabled(cfg)
    cfg = MasterConfig.model_validate({"grpo": {"malformed_thinking_advantage": -7.0}})  # the reference's key
    with pytest.raises(NotImplementedError, match=r"\(grpo\.malformed_thinking_advantage\).*data_plane"):
        _raise_if_message_level_advantage_penalties_enabled(cfg)


def test_train_fields_for_step():
    assert "prev_logprobs" in _train_fields_for_step(False)
    assert "prev_logprobs" not in _train_fields_for_step(True)
    assert "reference_policy_logprobs" not in _train_fields_for_step(False, True)


def test_seq_logprob_error_metrics_hand_computed(tiny_model_dir, char_tokenizer):
    """Rows reduced on the workers give the hand-computed per-sequence errors and the threshold mask."""
    from relayrl.config import PolicyConfig
    from relayrl.models.policy.tq_policy import TQPolicy

    policy = TQPolicy(
        PolicyConfig(model_name=str(tiny_model_dir)),
        char_tokenizer,
        dp_cfg={"enabled": True, "backend": "memory"},
        init_reference_model=False,
    )
    try:
        policy.prepare_step(num_samples=2)
        n, s = 2, 6
        token_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
        gen = torch.zeros(n, s)
        prev = torch.zeros(n, s)
        prev[0, 5] = -0.5  # one token off by 0.5 -> err (3 + e^0.5) / 4
        prev[1, 2:6] = -1.0  # every token off by 1 -> err e
        bulk = {
            "input_ids": torch.ones(n, s, dtype=torch.long),
            "input_lengths": torch.full((n,), s),
            "generation_logprobs": gen,
            "token_mask": token_mask,
            "sample_mask": torch.ones(n),
        }
        meta = first_write(bulk, keys=["p_g0", "p_g1"], client=policy.dp_client, partition_id="train")
        policy.write_to_dataplane(meta, {"prev_logprobs": prev})
        rewards = torch.tensor([1.0, 0.0])
        mask, metrics = worker_seq_logprob_error_metrics(policy, meta, torch.ones(n), rewards, 2.0)
        driver_mask, driver_metrics = _compute_seq_logprob_error_metrics(  # the same columns, on the driver
            token_mask=token_mask,
            sample_mask=torch.ones(n),
            prev_logprobs=prev,
            generation_logprobs=gen,
            rewards=rewards,
            seq_logprob_error_threshold=2.0,
        )
        assert torch.equal(driver_mask, mask) and driver_metrics == pytest.approx(metrics)
        e0 = (3 + math.exp(0.5)) / 4
        assert metrics["max_seq_mult_prob_error"] == pytest.approx(math.e)
        assert metrics["min_seq_mult_prob_error"] == pytest.approx(e0)
        assert metrics["mean_seq_mult_prob_error"] == pytest.approx((e0 + math.e) / 2)
        assert mask.tolist() == [1.0, 0.0] and metrics["num_masked_seqs_by_logprob_error"] == 1.0
        assert metrics["masked_correct_pct"] == 0.0 and metrics["max_seq_mult_prob_error_after_mask"] == pytest.approx(
            e0
        )
        policy.finish_step(meta)
    finally:
        policy.shutdown()

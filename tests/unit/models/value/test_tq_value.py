"""TQValue on the memory backend with a tiny Qwen2: values, critic updates and GAE through the data plane equal the
legacy `Value` and estimators (bit for bit on one worker), and a step that leaves a key behind fails."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.gae import GeneralizedAdvantageEstimator, RawRewardAdvantageEstimator, advantage_value_metrics
from relayrl.algorithms.value_loss import MseValueLossFn
from relayrl.config import ClusterConfig, DataPlaneConfig, ValueConfig
from relayrl.data_plane.column_io import first_write
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import DataPlaneClient, DataPlaneClosedError, KVBatchMeta, UnknownFieldError
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.tq_facade import DataPlaneLeakError
from relayrl.models.value.lm_value import Value
from relayrl.models.value.tq_value import PPO_TRAIN_FIELDS, TQValue
from tests import helpers
from tests.helpers import small_policy_config

DP_CFG = DataPlaneConfig(enabled=True, backend="memory", storage_capacity=10_000)
MULT = 4
LENGTHS = [12, 5, 7, 3, 11, 9, 4, 10]
BULK = ("input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask")


def make_config(model_dir: Path) -> ValueConfig:
    return small_policy_config(model_dir, ValueConfig, train_global_batch_size=8, logprob_batch_size=3)


def rollout_like_batch(vocab: int, pad_id: int, seed: int = 0) -> BatchedDataDict:
    """LENGTHS as the flatten pads them (tests.helpers.rollout_like_batch: row 3 masked out), with rewards."""
    batch = helpers.rollout_like_batch(LENGTHS, vocab, pad_id, mult=MULT, seed=seed)
    batch["rewards"] = torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0])  # [B]
    return batch


@pytest.fixture
def store() -> Iterator[DataPlaneClient]:
    """The driver's bootstrapped store (what the TQPolicy builds first in a run)."""
    client = build_data_plane_client(DP_CFG, bootstrap=True)
    yield client
    client.close()


@pytest.fixture
def make_value(tiny_model_dir: Path, char_tokenizer: Any, store: DataPlaneClient) -> Iterator[Callable[..., Any]]:
    made: list[Value] = []

    def build(kind: type[Value] = TQValue, dp: int = 1) -> Any:
        kwargs: dict[str, Any] = {"cluster": ClusterConfig(workers_per_node=dp, device="cpu")}
        if kind is TQValue:
            kwargs["dp_cfg"] = DP_CFG
        value = kind(make_config(tiny_model_dir), char_tokenizer, **kwargs)
        made.append(value)
        return value

    yield build
    for value in made:
        value.shutdown()


def seed_step(value: TQValue, batch: BatchedDataDict) -> KVBatchMeta:
    """Register the PPO partition, write the bulk as the rollout actor does and the rewards as the driver does."""
    value.prepare_step(batch.size)
    producer = build_data_plane_client(DP_CFG, bootstrap=False)
    keys = [f"p{i // 2}_g{i % 2}" for i in range(batch.size)]
    meta = first_write(
        {k: batch[k] for k in BULK}, keys=keys, client=producer, partition_id="train", pad_to_multiple=MULT
    )
    producer.close()
    value.write_to_dataplane(meta, {"rewards": batch["rewards"]})
    return meta


@pytest.mark.parametrize("dp", [1, 2])
def test_get_values_from_meta_writes_the_legacy_values(make_value, char_tokenizer, dp) -> None:
    batch = rollout_like_batch(len(char_tokenizer), char_tokenizer.pad_token_id)
    legacy = make_value(Value, dp=dp)  # same sharding and micro-batches: same bits
    expected = legacy.get_values(batch.select_keys(["input_ids", "input_lengths"]))["values"]  # [B, S]
    value = make_value(dp=dp)
    meta = seed_step(value, batch)
    assert value.get_values_from_meta(meta) is None  # the driver only waits
    stored = value.read_from_dataplane(meta, select_fields=["values"])["values"]  # [B, S]
    assert stored.shape == expected.shape and torch.equal(stored, expected)
    value.finish_step(meta)


def test_train_from_meta_equals_value_train(make_value, char_tokenizer) -> None:
    batch = rollout_like_batch(len(char_tokenizer), char_tokenizer.pad_token_id)
    legacy, tq = make_value(Value), make_value()
    meta = seed_step(tq, batch)
    tq.get_values_from_meta(meta)
    values = tq.read_from_dataplane(meta, select_fields=["values"])["values"]  # [B, S]
    returns = values + torch.linspace(-1.0, 1.0, values.shape[1]) * (values != 0)  # [B, S] targets off the values
    tq.write_to_dataplane(meta, {"returns": returns})
    loss_fn = MseValueLossFn(1.0, value_clip=0.05)
    data = BatchedDataDict({**batch, "values": values, "returns": returns})
    for _ in range(2):  # two epochs: the optimizer state must evolve identically too
        a = legacy.train(data, loss_fn)
        b = tq.train_from_meta(meta, loss_fn)
        assert torch.equal(a["loss"], b["loss"]) and a["metrics"] == b["metrics"]
    assert 0.0 < b["metrics"]["vf_clipfrac"] <= 1.0 and "explained_var" in b["metrics"]
    for key, tensor in legacy.state_dict().items():
        assert torch.equal(tensor, tq.state_dict()[key]), key
    with pytest.raises(ValueError, match="not a positive multiple of the global batch"):
        tq.train_from_meta(meta.slice(0, 6), loss_fn)
    tq.finish_step(meta)


def _legacy_advantages(batch: BatchedDataDict, values: torch.Tensor, estimator: Any) -> tuple[Any, ...]:
    mask = batch["token_mask"] * batch["sample_mask"].unsqueeze(-1)  # [B, S]
    adv, ret = estimator.compute_advantage(torch.zeros(batch.size, 1), batch["rewards"], mask, values)
    return adv, ret, advantage_value_metrics(adv, ret, values, mask)


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("kind", ["gae", "raw_reward"])
def test_compute_advantages_from_meta_matches_the_estimator(make_value, char_tokenizer, dp, kind) -> None:
    batch = rollout_like_batch(len(char_tokenizer), char_tokenizer.pad_token_id, seed=1)
    value = make_value(dp=dp)
    meta = seed_step(value, batch)
    value.get_values_from_meta(meta)
    values = value.read_from_dataplane(meta, select_fields=["values"])["values"]  # [B, S]
    gae = GeneralizedAdvantageEstimator(gamma=1.0, lam=0.95, normalize_advantages=True)
    estimator = gae if kind == "gae" else RawRewardAdvantageEstimator(1.0, True, gae)
    expected_adv, expected_ret, expected_metrics = _legacy_advantages(batch, values, estimator)

    metrics = value.compute_advantages_from_meta(meta, estimator)
    got = value.read_from_dataplane(meta, select_fields=["advantages", "returns"])
    real = torch.arange(values.shape[1])[None, :] < batch["input_lengths"][:, None]  # [B, S]; padding not stored
    if dp == 1:  # one shard: the estimator itself ran, bit for bit
        assert torch.equal(got["advantages"], expected_adv * real) and torch.equal(got["returns"], expected_ret)
        assert metrics == expected_metrics
    else:  # two shards: whitening from summed float64 moments
        assert torch.allclose(got["advantages"], expected_adv * real, atol=1e-5)
        assert torch.equal(got["returns"], expected_ret)  # GAE itself is row-local
        assert metrics == pytest.approx(expected_metrics, abs=1e-5)
    assert metrics["advantages/max"] > 0 > metrics["advantages/min"]
    value.finish_step(meta)


def test_finish_step_fails_on_a_leaked_key(make_value, char_tokenizer) -> None:
    batch = rollout_like_batch(len(char_tokenizer), char_tokenizer.pad_token_id)
    value = make_value()
    meta = seed_step(value, batch)
    value.finish_step(meta)  # every key consumed: passes and empties the partition
    assert value.dp_client.keys("train") == []

    meta = seed_step(value, batch)
    trained = meta.slice(0, 6)  # as if two rows were dropped mid-step without discard_samples
    with pytest.raises(DataPlaneLeakError, match=r"still holds 2 keys.*'p3_g0', 'p3_g1'"):
        value.finish_step(trained)
    assert value.discard_samples(["p3_g0", "p3_g1", "never"], "train") == 2
    assert value.dp_client.keys("train") == []


def test_partition_schema_and_driver_writes(make_value, char_tokenizer) -> None:
    batch = rollout_like_batch(len(char_tokenizer), char_tokenizer.pad_token_id)
    value = make_value()
    meta = seed_step(value, batch)
    returns = torch.arange(float(meta.size * 12)).reshape(meta.size, 12)  # [B, S] with junk on the padding
    value.write_to_dataplane(meta, {"returns": returns, "sample_mask": torch.zeros(meta.size)})
    got = value.read_from_dataplane(meta, select_fields=["returns", "sample_mask", "rewards"])
    real = torch.arange(12)[None, :] < batch["input_lengths"][:, None]  # [B, S]
    assert torch.equal(got["returns"], returns * real)  # stored unpadded by sequence length
    assert got["sample_mask"].tolist() == [0.0] * meta.size and torch.equal(got["rewards"], batch["rewards"])
    with pytest.raises(UnknownFieldError):
        value.write_to_dataplane(meta, {"not_a_ppo_field": torch.zeros(meta.size)})
    assert {"values", "returns", "rewards", "advantages", "prev_logprobs"} <= set(PPO_TRAIN_FIELDS)
    with pytest.raises(ValueError, match="positive int"):
        value.prepare_step(0)
    with pytest.raises(ValueError, match="has no keys"):
        value.get_values_from_meta(meta.slice(0, 0))
    value.finish_step(meta)


def test_bytes_are_metered_and_shutdown_closes_client_then_workers(make_value, char_tokenizer) -> None:
    batch = rollout_like_batch(len(char_tokenizer), char_tokenizer.pad_token_id)
    value = make_value(dp=2)
    value.data_plane_metrics(reset=True)
    meta = seed_step(value, batch)
    value.get_values_from_meta(meta)
    m = value.data_plane_metrics(reset=True)
    assert m["data_plane/driver_bytes"] == 4 * meta.size  # the float32 rewards the driver wrote, nothing else
    assert m["data_plane/workers/put_bytes"] == 4 * sum(LENGTHS) + 8 * meta.size  # values unpadded + lengths
    assert m["data_plane/workers/get_bytes"] > m["data_plane/workers/put_bytes"]  # input ids and lengths
    value.finish_step(meta)
    assert value.shutdown() is True
    with pytest.raises(DataPlaneClosedError):
        value.dp_client.keys("train")
    with pytest.raises(Exception, match="shut down|closed|no live"):
        value.get_values_from_meta(meta)

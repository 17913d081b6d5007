"""TQPolicy on the memory backend with a tiny Qwen2: every data-plane path equals the legacy Policy bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.logprob_error import compute_seq_logprob_error_metrics
from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.config import ClippedPGLossConfig, ClusterConfig, DataPlaneConfig, PolicyConfig
from relayrl.data_plane.column_io import first_write
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import DataPlaneClient, DataPlaneClosedError, KVBatchMeta
from relayrl.data_plane.preshard import shard_meta_for_dp
from relayrl.data_plane.schema import DP_TRAIN_FIELDS, GLOBAL_FORWARD_PAD_SEQLEN, PAD_TO_MULTIPLE
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.tq_policy import TQPolicy, _aggregate_train_results
from relayrl.models.policy.tq_worker import TQPolicyWorker
from relayrl.models.tq_facade import DataPlaneLeakError
from tests import helpers
from tests.helpers import small_policy_config

DP_CFG = DataPlaneConfig(enabled=True, backend="memory", storage_capacity=10_000)
MULT = 4  # make_sequence_length_divisible_by
BULK = ("input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask")


def make_config(model_dir: Path, **overrides: Any) -> PolicyConfig:
    keys = dict(train_global_batch_size=8, logprob_batch_size=3, make_sequence_length_divisible_by=MULT)
    return small_policy_config(model_dir, **{**keys, **overrides})


def rollout_like_batch(lengths: list[int], vocab: int, pad_id: int, seed: int = 0) -> BatchedDataDict:
    """What the legacy flatten produces (tests.helpers.rollout_like_batch), generation log-probs in (-2, 0]."""
    return helpers.rollout_like_batch(lengths, vocab, pad_id, mult=MULT, seed=seed, logprob_scale=2.0)


def seed_step(policy: TQPolicy, batch: BatchedDataDict, group_size: int = 2) -> tuple[KVBatchMeta, DataPlaneClient]:
    """Register the step and write the bulk from a non-driver client, as the rollout actor does."""
    n = batch.size
    policy.prepare_step(n, group_size)
    producer = build_data_plane_client(DP_CFG, bootstrap=False)
    keys = [f"p{i // group_size}_g{i % group_size}" for i in range(n)]
    meta = first_write(
        {k: batch[k] for k in BULK}, keys=keys, client=producer, partition_id="train", pad_to_multiple=MULT
    )
    return meta, producer


@pytest.fixture
def make_policy(tiny_model_dir: Path, char_tokenizer: Any) -> Iterator[Callable[..., Policy]]:
    made: list[Policy] = []

    def build(kind: type[Policy] = TQPolicy, dp: int = 1, **overrides: Any) -> Any:
        cluster = ClusterConfig(workers_per_node=dp, device="cpu")
        kwargs: dict[str, Any] = {"cluster": cluster}
        if kind is TQPolicy:
            kwargs["dp_cfg"] = DP_CFG
        policy = kind(make_config(tiny_model_dir, **overrides), char_tokenizer, **kwargs)
        made.append(policy)
        return policy

    yield build
    for p in made:
        p.shutdown()


def lengths_for(n: int, seed: int = 1, low: int = 5, high: int = 23) -> list[int]:
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------------- construction
def test_constructor_attaches_every_worker_and_validates_config(make_policy: Callable[..., Any]) -> None:
    policy = make_policy(dp=2)
    assert policy.tq_partition_id == "train" and policy.dp_cfg == DP_CFG
    for rank in range(2):
        worker = policy.worker_group.worker(rank)
        assert isinstance(worker, TQPolicyWorker) and worker.data_plane.attached
    assert isinstance(policy.model, Policy) and policy.model.worker_group is policy.worker_group
    with pytest.raises(ValueError, match="disabled"):
        TQPolicy(policy.cfg, policy.tokenizer, dp_cfg={"enabled": False})
    with pytest.raises(ValueError, match="tq_partition_id"):
        TQPolicy(policy.cfg, policy.tokenizer, dp_cfg=DP_CFG, tq_partition_id="")


def test_shutdown_closes_the_client_then_the_workers(make_policy: Callable[..., Any]) -> None:
    policy = make_policy()
    assert policy.shutdown() is True
    with pytest.raises(DataPlaneClosedError):
        policy.dp_client.register_partition("x", ["input_ids"], 1, ["t"])
    with pytest.raises(RuntimeError, match="shut down"):
        policy.prepare_for_training()


# ---------------------------------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("dp", [1, 2])
def test_logprobs_from_meta_equal_policy_logprobs(
    make_policy: Callable[..., Any], char_tokenizer: Any, dp: int
) -> None:
    policy = make_policy(dp=dp)
    batch = rollout_like_batch(lengths_for(10), len(char_tokenizer), char_tokenizer.pad_token_id)
    meta, _ = seed_step(policy, batch)
    assert policy.get_logprobs_from_meta(meta) is None
    assert policy.get_reference_policy_logprobs_from_meta(meta) is None
    got = policy.read_from_dataplane(meta, select_fields=["prev_logprobs", "reference_policy_logprobs"])
    lp_data = batch.select_keys(["input_ids", "input_lengths", "token_mask", "sample_mask"])
    want_prev = policy.get_logprobs(lp_data)["logprobs"]  # [B, S]
    want_ref = policy.get_reference_policy_logprobs(lp_data)["reference_logprobs"]  # [B, S]
    assert got["prev_logprobs"].shape == want_prev.shape == batch["input_ids"].shape
    assert torch.equal(got["prev_logprobs"], want_prev)
    assert torch.equal(got["reference_policy_logprobs"], want_ref)

    # per-row log-prob error reduced on the workers == the legacy driver-side computation
    rows = policy.seq_logprob_error_from_meta(meta)
    has_tokens = rows["num_loss_tokens"] > 0
    rewards = torch.tensor([1.0, 0.0] * 5)
    for threshold in (None, float(rows["seq_logprob_error"][has_tokens].median())):
        mask, legacy = compute_seq_logprob_error_metrics(
            batch["token_mask"], batch["sample_mask"], want_prev, batch["generation_logprobs"], rewards, threshold
        )
        err = rows["seq_logprob_error"]
        assert legacy["max_seq_mult_prob_error"] == float(err[has_tokens].max())
        assert legacy["mean_seq_mult_prob_error"] == float(err[has_tokens].mean())
        assert legacy["min_seq_mult_prob_error"] == float(err[has_tokens].min())
        if threshold is not None:
            assert torch.equal(mask, (err <= threshold).float() * batch["sample_mask"])
            assert 0 < legacy["num_masked_seqs_by_logprob_error"] < int(batch["sample_mask"].sum())


def test_dp2_workers_fetch_disjoint_slices_whose_union_is_the_step(
    make_policy: Callable[..., Any], char_tokenizer: Any
) -> None:
    policy = make_policy(dp=2)
    batch = rollout_like_batch(lengths_for(9, seed=4), len(char_tokenizer), char_tokenizer.pad_token_id)
    meta, _ = seed_step(policy, batch, group_size=1)
    policy.get_logprobs_from_meta(meta)
    per_rank = policy.worker_group.run_all(TQPolicyWorker.data_plane_metrics)
    fetched = [int(m["data_plane/get/keys"]) for m in per_rank]
    written = [int(m["data_plane/put/keys"]) for m in per_rank]
    shards = shard_meta_for_dp(meta, 2)
    assert fetched == written == [s.size for s in shards] == [5, 4]
    assert set(shards[0].keys).isdisjoint(shards[1].keys) and shards[0].keys + shards[1].keys == meta.keys
    # every key of the step got its result exactly once, from the rank that fetched it
    assert sum(written) == meta.size
    assert policy.read_from_dataplane(meta, select_fields=["prev_logprobs"])["prev_logprobs"].shape[0] == meta.size
    driver = policy.data_plane_metrics()
    assert "data_plane/put/bytes" not in driver  # the driver wrote nothing; only the read above passed through it
    assert driver["data_plane/driver_bytes"] == driver["data_plane/get/bytes"] > 0


# ---------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("variant", ["per_row_advantages", "per_token_advantages", "skipped_logprobs"])
@pytest.mark.parametrize("dp", [1, 2])
def test_train_from_meta_equals_policy_train(
    make_policy: Callable[..., Any], char_tokenizer: Any, variant: str, dp: int
) -> None:
    legacy: Policy = make_policy(Policy, dp=dp)
    policy: TQPolicy = make_policy(dp=dp)
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.05))
    batch = rollout_like_batch(lengths_for(16, seed=7), len(char_tokenizer), char_tokenizer.pad_token_id, seed=3)
    meta, _ = seed_step(policy, batch)
    adv_rows = torch.randn(16, generator=torch.Generator().manual_seed(5))  # [B]
    sample_mask = batch["sample_mask"].clone()
    sample_mask[0] = 0.0  # the driver overwrites the rollout's mask (logprob-error masking, overlong filtering)

    data = batch.copy()
    data["sample_mask"] = sample_mask
    data["advantages"] = adv_rows.unsqueeze(-1).expand(-1, batch["input_ids"].shape[1])  # [B, S], as GRPO builds it
    lp_data = batch.select_keys(["input_ids", "input_lengths", "token_mask", "sample_mask"])
    zeros = torch.zeros_like(batch["generation_logprobs"])
    skip = variant == "skipped_logprobs"
    data["prev_logprobs"] = zeros if skip else legacy.get_logprobs(lp_data)["logprobs"]
    data["reference_policy_logprobs"] = (
        zeros if skip else legacy.get_reference_policy_logprobs(lp_data)["reference_logprobs"]
    )
    want = legacy.train(data, loss_fn)
    assert float(want["loss"].abs().sum()) > 0 and float(want["grad_norm"]) > 0

    train_fields = list(DP_TRAIN_FIELDS)
    if skip:
        train_fields = [f for f in train_fields if f not in ("prev_logprobs", "reference_policy_logprobs")]
    else:
        policy.get_logprobs_from_meta(meta)
        policy.get_reference_policy_logprobs_from_meta(meta)
    adv = adv_rows if variant == "per_row_advantages" else data["advantages"]
    policy.write_to_dataplane(meta, {"advantages": adv, "sample_mask": sample_mask})
    got = policy.train_from_meta(meta, loss_fn, train_fields=train_fields)

    assert torch.equal(got["loss"], want["loss"]) and torch.equal(got["grad_norm"], want["grad_norm"])
    assert got["all_mb_metrics"] == want["all_mb_metrics"]
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    new, old = policy.state_dict_for_refit(), legacy.state_dict_for_refit()
    assert all(torch.equal(new[k], old[k]) for k in old)
    assert policy.weights_version == legacy.weights_version == 2  # two global batches of 8


def test_train_from_meta_rejects_bad_batch_sizes(make_policy: Callable[..., Any], char_tokenizer: Any) -> None:
    policy = make_policy()
    batch = rollout_like_batch(lengths_for(6), len(char_tokenizer), char_tokenizer.pad_token_id)
    meta, _ = seed_step(policy, batch)
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    with pytest.raises(ValueError, match="not a positive multiple of the global batch size 8"):
        policy.train_from_meta(meta, loss_fn)
    with pytest.raises(ValueError, match="whole micro-batches"):
        policy.train_from_meta(meta, loss_fn, gbs=6, mbs=4)
    with pytest.raises(ValueError, match="has no keys"):
        policy.train_from_meta(KVBatchMeta("train", [], sequence_lengths=[]), loss_fn)


def test_aggregate_train_results_merges_like_policy_train() -> None:
    results = [
        {"loss": torch.tensor([1.0]), "grad_norm": 2.0, "rank": 0, "all_mb_metrics": {"loss": [0.1], "lr": [1e-3]}},
        {"loss": torch.tensor([1.0]), "grad_norm": 2.0, "rank": 1, "all_mb_metrics": {"loss": [0.2], "lr": [1e-3]}},
    ]
    out = _aggregate_train_results(results)
    assert out["rank"] == 0 and out["grad_norm"] == 2.0
    assert out["all_mb_metrics"] == {"loss": [0.1, 0.2], "lr": [1e-3, 1e-3]}
    with pytest.raises(ValueError, match="no worker results"):
        _aggregate_train_results([])


# ---------------------------------------------------------------------------------------------------- lifecycle
def test_finish_step_empties_the_partition_and_a_leak_is_an_error(
    make_policy: Callable[..., Any], char_tokenizer: Any
) -> None:
    policy = make_policy()
    batch = rollout_like_batch(lengths_for(6), len(char_tokenizer), char_tokenizer.pad_token_id)
    meta, _ = seed_step(policy, batch)
    assert policy.discard_samples(meta.keys[:2], "train") is None  # e.g. dynamic sampling dropped a group
    assert policy._partition_keys("train") == meta.keys[2:]
    policy.finish_step(meta.slice(2, 6))
    assert policy._partition_keys("train") == [] and policy.dp_client.bytes_held()["train"] == 0

    meta, _ = seed_step(policy, batch)  # the partition is reusable next step
    with pytest.raises(DataPlaneLeakError, match=r"1 keys after finish_step: \['p2_g1'\]"):
        policy.finish_step(meta.slice(0, 5))
    with pytest.raises(ValueError, match="still holds 1 samples"):
        policy.prepare_step(6, 2)  # a leaked key also blocks the next step


def test_prepare_partitions_and_discard(make_policy: Callable[..., Any]) -> None:
    policy = make_policy()
    policy.prepare_val_partition(3)
    producer = build_data_plane_client(DP_CFG, bootstrap=False)
    producer.put_samples(["a_g0", "b_g0"], "val", {"sample_mask": torch.ones(2)})
    assert policy.discard_samples(["a_g0", "zz"], "val") is None  # ids not in the store are ignored
    assert policy._partition_keys("val") == ["b_g0"]
    with pytest.raises(TypeError, match="not a single string"):
        policy.discard_samples("b_g0", "val")
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        policy.prepare_step(0)
    with pytest.raises(KeyError, match="advantages_typo"):
        producer.put_samples(["c_g0"], "val", {"advantages_typo": torch.ones(1)})


def test_stamp_pad_seqlen_is_idempotent(make_policy: Callable[..., Any]) -> None:
    policy = make_policy()
    lens = [1204, 499, 1445, 876, 361, 487, 927, 678]
    meta = KVBatchMeta("train", [f"k{i}" for i in range(8)], sequence_lengths=lens, extra_info={PAD_TO_MULTIPLE: 8})
    policy._stamp_pad_seqlen(meta)
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 1448
    meta.sequence_lengths = [1500] * 8
    policy._stamp_pad_seqlen(meta)
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 1448  # already stamped: unchanged
    no_mult = KVBatchMeta("train", ["a", "b"], sequence_lengths=[9, 3])
    policy._stamp_pad_seqlen(no_mult)
    assert no_mult.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 12  # falls back to make_sequence_length_divisible_by
    empty = KVBatchMeta("train", [], sequence_lengths=[])
    policy._stamp_pad_seqlen(empty)
    assert GLOBAL_FORWARD_PAD_SEQLEN not in empty.extra_info
    assert policy._packing_args("train_mb_tokens") == (None, None) == policy._packing_args("logprob_mb_tokens")
    with pytest.raises(ValueError, match="unknown stage key"):
        policy._packing_args("mb_tokens")


def test_read_and_write_dataplane(make_policy: Callable[..., Any], char_tokenizer: Any) -> None:
    policy = make_policy()
    batch = rollout_like_batch([5, 9, 7, 2], len(char_tokenizer), char_tokenizer.pad_token_id)
    meta, _ = seed_step(policy, batch)
    got = policy.read_from_dataplane(meta, select_fields=list(BULK))
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 12
    for key in BULK:
        assert torch.equal(got[key], batch[key]), key  # pad id for input_ids, 0 elsewhere: the legacy padding
    assert got["input_ids"][3, 2:].eq(char_tokenizer.pad_token_id).all()
    zero_pad = policy.read_from_dataplane(meta, select_fields=["input_ids"], pad_value_dict={"input_ids": 0})
    assert zero_pad["input_ids"][3, 2:].eq(0).all()
    adv = torch.arange(4 * 12, dtype=torch.float32).view(4, 12)
    policy.write_to_dataplane(meta, {"advantages": adv})
    back = policy.read_from_dataplane(meta, select_fields=["advantages"])["advantages"]
    assert torch.equal(back, adv * (torch.arange(12)[None, :] < batch["input_lengths"][:, None]))  # stored unpadded
    with pytest.raises(ValueError, match="non-empty mapping"):
        policy.write_to_dataplane(meta, {})
    with pytest.raises(ValueError, match="select_fields"):
        policy.read_from_dataplane(meta, select_fields=[])
    with pytest.raises(ValueError, match="sequence_lengths is required"):
        policy.read_from_dataplane(KVBatchMeta("train", meta.keys), select_fields=["input_ids"])


# ---------------------------------------------------------------------------------------------------- accounting
def test_driver_moves_under_two_percent_of_the_store_bytes(
    make_policy: Callable[..., Any], char_tokenizer: Any
) -> None:
    """Realistic step: 16 rows of 60-250 tokens. The driver writes per-row advantages and sample mask only."""
    policy = make_policy(train_micro_batch_size=4, logprob_batch_size=8)
    lens = lengths_for(16, seed=11, low=60, high=250)
    batch = rollout_like_batch(lens, len(char_tokenizer), char_tokenizer.pad_token_id)
    meta, producer = seed_step(policy, batch)
    policy.data_plane_metrics(reset=True)
    policy.get_logprobs_from_meta(meta)
    policy.get_reference_policy_logprobs_from_meta(meta)
    policy.write_to_dataplane(meta, {"advantages": torch.randn(16), "sample_mask": batch["sample_mask"]})
    policy.train_from_meta(meta, ClippedPGLossFn(ClippedPGLossConfig()))
    m = policy.data_plane_metrics(extra=[producer.metrics()])
    assert m["data_plane/driver_bytes"] == 16 * 4 * 2  # two float32 per row
    assert m["data_plane/all/put_bytes"] > 16 * 60 * (8 + 4 + 8 + 4 + 4)  # ids, gen lp, mask, prev lp, ref lp
    assert m["data_plane/driver_fraction_of_written"] <= 0.02
    assert m["data_plane/all/get_bytes"] > 0
    policy.finish_step(meta)

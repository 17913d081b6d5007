"""Seed page 001, `nemo_rl.models.policy.tq_policy` -> `relayrl.models.policy.tq_policy`: `_aggregate_train_results`
and every `TQPolicy` method the page names, with its signature, plus `discard_samples` by the page's names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig, DataPlaneConfig, PolicyConfig
from relayrl.data_plane.column_io import first_write
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.models.policy.interfaces import ColocatablePolicyInterface
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.tq_policy import TQPolicy, _aggregate_train_results
from tests.unit.seeds.seed_signature import assert_seed_signature, seed_methods


def _aggregate_train_results_seed(results): ...


# The page's signatures, written out (annotations dropped; `*` markers and defaults kept).
class SeedTQPolicy:
    def __init__(self, *args, dp_cfg, tq_partition_id="train", **kwargs): ...
    def shutdown(self): ...
    def prepare_step(self, num_samples, group_size=None): ...
    def prepare_val_partition(self, num_samples, *, partition_id="val"): ...
    def discard_samples(self, sample_ids, partition_id): ...
    def finish_step(self, meta): ...
    def _stamp_pad_seqlen(self, meta): ...
    def read_from_dataplane(self, meta, *, select_fields, pad_value_dict=None): ...
    def write_to_dataplane(self, meta, fields): ...
    def _packing_args(self, mb_tokens_key): ...
    def _logprob_dispatch(self, meta, *, task_name, worker_method, timer_prefix, timer, common_kwargs): ...
    def get_logprobs_from_meta(self, meta, micro_batch_size=None, timer=None): ...
    def get_reference_policy_logprobs_from_meta(self, meta, micro_batch_size=None, timer=None): ...
    def train_from_meta(self, meta, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None): ...


def test_aggregate_train_results_signature() -> None:
    assert_seed_signature(_aggregate_train_results, _aggregate_train_results_seed, exact=True)


def test_tq_policy_implements_the_policy_interface_and_holds_a_policy() -> None:
    """The page lists `Policy` as the base; relayrl's `TQPolicy` holds the `Policy` it drives instead (composition)
    and implements the whole `ColocatablePolicyInterface` by forwarding to it."""
    assert issubclass(TQPolicy, ColocatablePolicyInterface) and not TQPolicy.__abstractmethods__
    assert not issubclass(TQPolicy, Policy)


@pytest.mark.parametrize("name", seed_methods(SeedTQPolicy))
def test_tq_policy_method(name: str) -> None:
    assert_seed_signature(getattr(TQPolicy, name), getattr(SeedTQPolicy, name))


def test_aggregate_train_results_returns_one_dict() -> None:
    out = _aggregate_train_results(
        [
            {"loss": 0.5, "grad_norm": 2.0, "all_mb_metrics": {"loss": [0.1]}},
            {"loss": 0.5, "grad_norm": 2.0, "all_mb_metrics": {"loss": [0.2]}},
        ]
    )
    assert isinstance(out, dict) and out["grad_norm"] == 2.0 and out["all_mb_metrics"] == {"loss": [0.1, 0.2]}


def test_discard_samples_takes_sample_ids_and_returns_none(tiny_model_dir: Path, char_tokenizer: Any) -> None:
    dp_cfg = DataPlaneConfig(enabled=True, backend="memory", storage_capacity=100)
    policy = TQPolicy(
        PolicyConfig(model_name=str(tiny_model_dir)),
        char_tokenizer,
        cluster=ClusterConfig(device="cpu"),
        dp_cfg=dp_cfg,
        init_reference_model=False,
    )
    try:
        assert policy.tq_partition_id == "train" and isinstance(policy.model, Policy)
        policy.prepare_step(num_samples=4, group_size=2)
        producer = build_data_plane_client(dp_cfg, bootstrap=False)  # writes the bulk, as the rollout actor does
        bulk = {"input_ids": torch.ones(4, 5, dtype=torch.long), "input_lengths": torch.full((4,), 5)}
        ids = ["a_g0", "a_g1", "b_g0", "b_g1"]
        meta = first_write(bulk, keys=ids, client=producer, partition_id="train")

        assert policy.discard_samples(sample_ids=["a_g0", "a_g1", "never_minted"], partition_id="train") is None
        assert sorted(policy.dp_client.keys("train")) == ["b_g0", "b_g1"]
        assert policy.finish_step(meta.slice(2, 4)) is None  # the rest: the partition is empty again
        assert list(policy.dp_client.keys("train")) == []

        policy.prepare_val_partition(2, partition_id="val")
        producer.put_samples(["v_g0", "v_g1"], "val", {"sample_mask": torch.ones(2)})
        policy.discard_samples(["v_g0", "v_g1"], "val")  # positionally too
        assert list(policy.dp_client.keys("val")) == []
    finally:
        policy.shutdown()

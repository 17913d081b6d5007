"""Sequence packing and dynamic batching change no result: on a length-skewed batch, log-probs, reference log-probs,
top-k logits, values, losses, gradient norms and the trained weights equal the unpacked run's within float32
rounding (tolerances derived in tests/unit/models/packing_runs.py), for GRPO's policy update (per-row advantages),
PPO's (per-token GAE advantages) and PPO's critic, on the legacy façades and on the data plane, with one and two
local data-parallel workers. The Ray executor's two workers: tests/integration/test_packing_ray.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig, DataPlaneConfig
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.schema import GLOBAL_FORWARD_PAD_SEQLEN
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.policy.tq_policy import TQPolicy
from tests.unit.models import packing_runs as runs

DP_CFG = DataPlaneConfig(enabled=True, backend="memory", storage_capacity=10_000)
HIDDEN = 64  # tests.helpers.TEST_MODEL


def outcome(kind: str, model: str, model_dir: Path, tokenizer: Any, mode: str, dp: int, batch: BatchedDataDict):
    built = runs.build(
        kind, model, model_dir, tokenizer, mode, ClusterConfig(workers_per_node=dp, device="cpu"), DP_CFG
    )
    try:
        if model == "value":
            return runs.run_value(built, batch)
        return runs.run_policy(built, batch, batch["ppo_advantages"] if "ppo_advantages" in batch else None)
    finally:
        built.shutdown()


@pytest.fixture(scope="module")
def batches(char_tokenizer: Any, tiny_model_dir: Path) -> dict[str, BatchedDataDict]:
    """GRPO's batch, and PPO's: per-token GAE advantages over the unpacked critic's values."""
    grpo = runs.make_batch(len(char_tokenizer))
    values = outcome("legacy", "value", tiny_model_dir, char_tokenizer, "unpacked", 1, grpo).passes["values"]
    ppo = grpo.copy()
    ppo["ppo_advantages"] = runs.ppo_advantages(grpo, values)  # [B, S]
    return {"grpo": grpo, "ppo": ppo, "value": grpo}


@pytest.fixture(scope="module")
def unpacked(batches: dict[str, BatchedDataDict], char_tokenizer: Any, tiny_model_dir: Path) -> dict[str, Any]:
    """The reference runs: legacy façade, one worker, neither mode."""
    model = {"grpo": "policy", "ppo": "policy", "value": "value"}
    return {
        algo: outcome("legacy", model[algo], tiny_model_dir, char_tokenizer, "unpacked", 1, batch)
        for algo, batch in batches.items()
    }


@pytest.fixture
def store() -> Iterator[None]:
    """The driver's memory store a critic attaches to (the policy bootstraps its own)."""
    client = build_data_plane_client(DP_CFG, bootstrap=True)
    yield
    client.close()


CASES = [
    (algo, kind, mode, dp)
    for algo in ("grpo", "value", "ppo")
    for kind in ("legacy", "tq")
    for mode in ("packing", "dynamic")
    for dp in (1, 2)
    if algo != "ppo" or dp == 2  # PPO's actor update differs from GRPO's only in its advantages
]


@pytest.mark.parametrize(("algo", "kind", "mode", "dp"), CASES)
def test_packed_and_dynamic_runs_equal_the_unpacked_run(
    algo: str,
    kind: str,
    mode: str,
    dp: int,
    batches: dict[str, BatchedDataDict],
    unpacked: dict[str, Any],
    char_tokenizer: Any,
    tiny_model_dir: Path,
    store: None,
) -> None:
    model = "value" if algo == "value" else "policy"
    batch = batches[algo]
    got = outcome(kind, model, tiny_model_dir, char_tokenizer, mode, dp, batch)
    if algo == "ppo":
        batch = BatchedDataDict({**batch, "advantages": batch["ppo_advantages"]})
    report = runs.compare(got, unpacked[algo], batch, model, vocab=len(char_tokenizer), hidden=HIDDEN)
    for name, (diff, tol) in report.items():
        assert diff <= tol, f"{name}: |difference| {diff:.3g} > tolerance {tol:.3g}"
        if name.startswith(("loss", "grad_norm", "weights", "mb_loss")):
            assert tol <= 1e-5, f"{name}: the derived tolerance {tol:.3g} misses the 1e-5 target"
    expected = {"logprobs", "reference", "weights"} if model == "policy" else {"values", "weights"}
    assert expected <= set(report) and (kind == "tq" or model == "value" or "topk" in report)
    for result in got.results:  # a real update happened: clipping active, every loss token counted
        assert float(result["grad_norm"]) > runs.MAX_GRAD_NORM
        assert result["num_valid_tokens"] == runs.global_counts(batch, 1 if model == "policy" else 0)[1]


def test_a_dropped_micro_batch_would_be_caught(
    batches: dict[str, BatchedDataDict], unpacked: dict[str, Any], char_tokenizer: Any, tiny_model_dir: Path
) -> None:
    """The tolerances are tight enough to see a real mistake: training without one row's loss tokens."""
    batch = batches["grpo"].copy()
    batch["token_mask"] = batch["token_mask"].clone()
    batch["token_mask"][2, 40:] = 0.0  # a third of one row's loss tokens left out
    got = outcome("legacy", "policy", tiny_model_dir, char_tokenizer, "packing", 1, batch)
    report = runs.compare(got, unpacked["grpo"], batches["grpo"], "policy", vocab=len(char_tokenizer), hidden=HIDDEN)
    for name in ("loss[0]", "grad_norm[0]", "loss[1]"):
        assert report[name][0] > 10 * report[name][1], (name, report[name])
    assert torch.equal(got.passes["logprobs"], unpacked["grpo"].passes["logprobs"])  # passes are untouched


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_tq_policy_packing_args_are_the_configs(mode: str, char_tokenizer: Any, tiny_model_dir: Path) -> None:
    """`TQPolicy._packing_args` hands the planner the configured budgets (it returned (None, None) before packing
    existed, and still does with both modes off); dynamic batching also rounds the batch-wide padded width."""
    policy = TQPolicy(runs.policy_config(tiny_model_dir, mode), char_tokenizer, dp_cfg=DP_CFG)
    try:
        packing, dynamic = policy._packing_args("train_mb_tokens")
        if mode == "packing":
            assert dynamic is None and packing is not None
            assert packing["max_tokens_per_microbatch"] == runs.BUDGET
            assert packing["algorithm"] == "modified_first_fit_decreasing"
        else:
            assert packing is None and dynamic == {"sequence_length_round": 8, "max_tokens_per_microbatch": runs.BUDGET}
        meta = KVBatchMeta("train", ["a", "b"], sequence_lengths=[9, 3])
        policy._stamp_pad_seqlen(meta)
        assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == (16 if mode == "dynamic" else 9)
    finally:
        policy.shutdown()

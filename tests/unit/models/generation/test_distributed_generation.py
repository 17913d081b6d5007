"""DistributedGeneration on the local executor: in-process generation workers, refit from an in-process Policy.

Two generation workers must give what one `HfGeneration` gives on the whole batch (same seed: the façade draws
the engine's U and shards it), sampled and greedy; both refit methods must leave every worker's weights
bit-identical to the trained policy's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.config import ClippedPGLossConfig, ClusterConfig, GenerationConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.generation.distributed import DistributedGeneration, contiguous_bounds
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.policy.lm_policy import Policy
from tests.helpers import small_policy_config

PROMPTS = ["12+34=", "7-3=", "hello world!", "ab", "99-1=", "x", "5+5=", "abc"]
GEN = dict(max_new_tokens=8, temperature=1.3, top_k=30, stop_strings=["e", "1", " "])


def policy_config(model_dir: Path, **generation: Any) -> PolicyConfig:
    return small_policy_config(model_dir, generation={**GEN, **generation})


def prompt_batch(tokenizer: Any) -> BatchedDataDict:
    encoded = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ids = torch.full((len(encoded), max(map(len, encoded)) + 1), tokenizer.pad_token_id, dtype=torch.long)  # [B, S]
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in encoded]))


def train_once(policy: Policy, vocab: int) -> None:
    """One real optimizer step, so the policy's weights (and weights_version) move away from the workers'."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 5, 7, 3])
    ids = torch.randint(2, vocab, (4, 9), generator=g)  # [B, S]
    real = torch.arange(9)[None] < lengths[:, None]
    data = BatchedDataDict(
        input_ids=ids.masked_fill(~real, 0),
        input_lengths=lengths,
        token_mask=real.float(),
        sample_mask=torch.ones(4),
        advantages=torch.randn(4, 1, generator=g).expand(4, 9).clone(),
    )
    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    data["generation_logprobs"] = data["prev_logprobs"].clone()
    data["reference_policy_logprobs"] = data["prev_logprobs"].clone()
    policy.train(data, ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)))


def assert_same_generation(out: BatchedDataDict, ref: BatchedDataDict) -> None:
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert torch.equal(out[key], ref[key]), key
    assert out["logprobs"].shape == ref["logprobs"].shape
    assert (out["logprobs"] - ref["logprobs"]).abs().max() <= 1e-4  # other batch shapes: float rounding only
    assert ("support" in out) == ("support" in ref)  # the sampler's kept sets (top_k) survive the workers' merge
    if "support" in ref:
        assert torch.equal(out["support"], ref["support"])


@pytest.fixture
def ipc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))  # ZMQ IPC sockets private to this test
    return tmp_path


def test_contiguous_bounds():
    assert contiguous_bounds(5, 2) == [(0, 3), (3, 5)]
    assert contiguous_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]


def test_two_colocated_workers_equal_one_engine_after_ipc_refit(tiny_model_dir, char_tokenizer, ipc_dir):
    cfg = policy_config(tiny_model_dir)
    cluster = ClusterConfig(workers_per_node=2)
    policy = Policy(cfg, char_tokenizer, cluster=cluster, init_reference_model=False)
    gen = DistributedGeneration(
        cfg.generation, char_tokenizer, policy, cluster=cluster, policy_config=cfg, max_total_sequence_length=20, seed=7
    )
    try:
        assert gen.world_size == 2
        train_once(policy, len(char_tokenizer))
        assert policy.weights_version == 1  # one global batch of 4 rows: one optimizer step
        gen.prepare_for_generation()
        assert gen.synced_weights_version == 1
        live = policy.state_dict_for_refit()
        for worker_weights in gen.worker_state_dicts():
            assert worker_weights.keys() == live.keys()
            assert all(torch.equal(v, worker_weights[k]) for k, v in live.items())
        metrics = gen.refit_metrics()
        model_bytes = sum(t.numel() * t.element_size() for k, t in live.items() if k != "lm_head.weight")  # tied: once
        assert metrics["refit/bytes"] == 2 * model_bytes and metrics["refit/total_count"] == 1
        gen.prepare_for_generation()  # nothing trained since: no second refit
        assert gen.refit_metrics()["refit/total_count"] == 1

        engine = HfGeneration(
            cfg.generation, char_tokenizer, policy.generation_source, max_total_sequence_length=20, seed=7
        )
        engine.prepare_for_generation()
        batch = prompt_batch(char_tokenizer)
        state, engine_state = gen.get_rng_state(), engine.get_rng_state()
        for greedy in (False, True, False):
            assert_same_generation(gen.generate(batch, greedy=greedy), engine.generate(batch, greedy=greedy))
        gen.set_rng_state(state)  # exact resume: the same stream again
        engine.set_rng_state(engine_state)
        assert_same_generation(gen.generate(batch), engine.generate(batch))
        lengths = engine.generate(prompt_batch(char_tokenizer))["generation_lengths"]
        assert int(lengths.min()) < int(lengths.max())  # rows stop at different steps: the merge really pads
    finally:
        gen.shutdown()
        policy.shutdown()


def test_dedicated_workers_refit_over_the_collective(tiny_model_dir, char_tokenizer):
    cfg = policy_config(
        tiny_model_dir, colocated={"enabled": False, "resources": {"num_nodes": 1, "workers_per_node": 2}}
    )
    policy = Policy(cfg, char_tokenizer, cluster=ClusterConfig(), init_reference_model=False)
    gen = DistributedGeneration(cfg.generation, char_tokenizer, policy, cluster=ClusterConfig(), policy_config=cfg)
    try:
        assert gen.world_size == 2
        train_once(policy, len(char_tokenizer))
        before = gen.worker_state_dicts()[0]
        live = policy.state_dict_for_refit()
        assert any(not torch.equal(v, before[k]) for k, v in live.items())  # stale until the refit
        gen.prepare_for_generation()
        for worker_weights in gen.worker_state_dicts():
            assert all(torch.equal(v, worker_weights[k]) for k, v in live.items())
        assert gen.refit_metrics()["refit/colocated"] == 0.0
        out = gen.generate(prompt_batch(char_tokenizer), greedy=True)
        assert out["output_ids"].shape == (len(PROMPTS), prompt_batch(char_tokenizer)["input_ids"].shape[1] + 8)
    finally:
        gen.shutdown()
        policy.shutdown()


def test_config_errors(tiny_model_dir, char_tokenizer):
    cfg = policy_config(tiny_model_dir, colocated={"enabled": False})
    with pytest.raises(ValueError, match="colocated.resources"):
        DistributedGeneration(cfg.generation, char_tokenizer, object(), cluster=ClusterConfig(), policy_config=cfg)
    with pytest.raises(TypeError, match="GenerationConfig"):
        DistributedGeneration(dict(GEN), char_tokenizer, object(), cluster=ClusterConfig(), policy_config=cfg)  # type: ignore[arg-type]
    assert GenerationConfig().colocated.resources.num_nodes is None

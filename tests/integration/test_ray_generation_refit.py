"""Ray generation workers refitted from a 2-rank Ray policy after a training step, by both refit methods.

After the refit every generation worker holds the policy's weights bit for bit, and greedy generation on the
workers gives the tokens one engine gives on the policy's weights, with log-probs equal to `Policy.get_logprobs`
(T=1) on the generated sequences. Refit verification compares the workers' digests with the policy's at every
`prepare_for_generation`: it passes after each refit and names the worker left on the old weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.refit_digest import RefitVerificationError
from relayrl.models.generation.distributed import DistributedGeneration
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.generation.worker import GenerationWorker
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.worker import load_causal_lm
from tests.helpers import f32_tol, ragged_batch, small_policy_config, train_on_policy

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 6  # the shared `ray_cluster` fixture (tests/conftest.py) reads it

PROMPTS = ["12+34=", "7-3=", "hello world!", "ab", "99-1=", "x"]


class _Source:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights_version = 0


def config(model_dir: Path, colocated: dict[str, Any]) -> PolicyConfig:
    return small_policy_config(model_dir, generation={"max_new_tokens": 8, "colocated": colocated})


def train_once(policy: Policy, vocab: int) -> None:
    lengths = torch.tensor([9, 5, 7, 3])
    train_on_policy(policy, ragged_batch(vocab, 0, lengths, torch.ones(4), seq_len=9, prompt_len=0))


def prompts(tokenizer: Any) -> BatchedDataDict:
    encoded = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ids = torch.full((len(encoded), max(map(len, encoded))), tokenizer.pad_token_id, dtype=torch.long)  # [B, S]
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in encoded]))


def check_refit(gen: DistributedGeneration, policy: Policy, cfg: PolicyConfig, tokenizer: Any) -> dict[str, float]:
    """Refit, then: bit-identical weights; greedy tokens as one engine on the policy's weights; logprobs as
    Policy.get_logprobs."""
    live = {k: v.detach().clone() for k, v in policy.state_dict_for_refit().items()}
    assert any(not torch.equal(v, gen.worker_state_dicts()[0][k]) for k, v in live.items())  # stale before
    gen.prepare_for_generation()
    for weights in gen.worker_state_dicts():
        assert weights.keys() == live.keys()
        assert all(torch.equal(v, weights[k]) for k, v in live.items())
    metrics = gen.refit_metrics()

    batch = prompts(tokenizer)
    out = gen.generate(batch, greedy=True)
    model = load_causal_lm(cfg)
    model.load_state_dict(live)
    ref = HfGeneration(cfg.generation, tokenizer, _Source(model)).generate(batch, greedy=True)
    assert torch.equal(out["output_ids"], ref["output_ids"])
    assert torch.equal(out["generation_lengths"], ref["generation_lengths"])

    seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    policy_lp = policy.get_logprobs(seqs)["logprobs"]  # [B, W], token-aligned like the generation logprobs
    cols = torch.arange(out["output_ids"].shape[1])[None]
    generated = (cols >= batch["input_lengths"][:, None]) & (cols < out["unpadded_sequence_lengths"][:, None])
    assert int(generated.sum()) > len(PROMPTS)
    diff = (out["logprobs"] - policy_lp).abs()[generated].max()
    # float32 rounding of a logit minus the log-sum-exp over the vocabulary (n = vocabulary size)
    tol = f32_tol(float(policy_lp.abs()[generated].max()), len(tokenizer))
    assert diff <= tol, f"generation logprobs differ from Policy.get_logprobs by {float(diff)} (> {tol:.2g})"
    return metrics


def test_both_refit_methods_after_a_training_step(
    ray_cluster: None, tiny_model_dir: Path, char_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))  # ZMQ IPC sockets private to this test
    cluster = ClusterConfig(executor="ray", workers_per_node=2)
    results = {}
    # one policy (its ranks do not depend on how generation is placed) serves both methods, each trained a step more
    policy = Policy(
        config(tiny_model_dir, {"enabled": True}), char_tokenizer, cluster=cluster, init_reference_model=False
    )
    try:
        for name, colocated in (
            ("zmq_ipc", {"enabled": True}),
            ("collective", {"enabled": False, "resources": {"num_nodes": 1, "workers_per_node": 2}}),
        ):
            cfg = config(tiny_model_dir, colocated)
            gen = DistributedGeneration(
                cfg.generation, char_tokenizer, policy, cluster=cluster, policy_config=cfg, seed=3
            )
            try:
                assert gen.world_size == 2
                gen.prepare_for_generation()  # the workers start from the policy's weights too
                before = {k: v.detach().clone() for k, v in policy.state_dict_for_refit().items()}
                train_once(policy, len(char_tokenizer))
                results[name] = check_refit(gen, policy, cfg, char_tokenizer)  # verified by digests: no mismatch
                assert gen.refit_metrics()["refit/total_count"] == 2
                # refit verification: worker 1 back on the weights before the step, under the current version
                live = {k: v.detach().clone() for k, v in policy.state_dict_for_refit().items()}
                gen._group.run_sharded(GenerationWorker.load_weights, [live, before], policy.weights_version)
                with pytest.raises(
                    RefitVerificationError, match=r"on generation worker 1 is not the trainer's .*after the last refit"
                ):
                    gen.prepare_for_generation()
            finally:
                gen.shutdown()
    finally:
        policy.shutdown()
    for name, m in results.items():
        print(
            f"refit {name}: {m['refit/time_s'] * 1e3:.1f} ms for {m['refit/bytes'] / 2**20:.2f} MB received "
            f"({m['refit/ms_per_mb']:.1f} ms/MB)"
        )
        assert m["refit/bytes"] > 0

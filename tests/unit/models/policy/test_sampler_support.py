"""The sampler's own top-k/top-p kept set in the policy's log-prob and training passes (`generation_support`).

A float32 policy scores tokens that a bfloat16 engine sampled: the filter recomputed from the policy's logits keeps
other sets than the sampler did at a few tokens (`sampling/support_mismatch` counts them), and the passes use the
recorded sets instead. On-policy in float32 the two agree everywhere and the counter is exactly zero."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.config import ClippedPGLossConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.generation.sampling import support_mask
from relayrl.models.policy.lm_policy import Policy

PROMPTS = ["12+34=", "7-3=", "hello", "ab", "99-1=", "x", "5*5=", "q"]
TOP_K = 3


@pytest.fixture(scope="module")
def policy(tiny_model_dir, char_tokenizer) -> Any:
    cfg = PolicyConfig.model_validate(
        dict(
            model_name=str(tiny_model_dir),
            train_global_batch_size=8,
            train_micro_batch_size=4,
            generation={"top_k": TOP_K, "max_new_tokens": 12},
        )
    )
    p = Policy(cfg, char_tokenizer, init_reference_model=False)
    yield p
    p.shutdown()


def rollout(policy: Policy, tokenizer: Any, precision: str) -> BatchedDataDict:
    """Generate from the policy's live weights in `precision`; the batch the passes read, with the record."""
    engine = HfGeneration(policy.cfg.generation, tokenizer, policy.generation_source, precision=precision, seed=0)
    encoded = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ids = torch.full((len(PROMPTS), max(map(len, encoded))), tokenizer.pad_token_id)  # [B, P]
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    lengths = torch.tensor([len(e) for e in encoded])  # [B]
    engine.prepare_for_generation()
    out = engine.generate(BatchedDataDict(input_ids=ids, input_lengths=lengths), seed=0)
    engine.finish_generation()
    positions = torch.arange(out["output_ids"].shape[1])[None]  # [1, S]
    generated = (positions >= lengths[:, None]) & (positions < out["unpadded_sequence_lengths"][:, None])  # [B, S]
    return BatchedDataDict(
        input_ids=out["output_ids"],
        input_lengths=out["unpadded_sequence_lengths"],
        token_mask=generated.float(),
        sample_mask=torch.ones(len(PROMPTS)),
        generation_logprobs=out["logprobs"],
        generation_support=out["support"],  # [B, S, K]
        advantages=torch.ones(out["output_ids"].shape),
    )


def support_counts(policy: Policy, data: BatchedDataDict) -> dict[str, float]:
    """The training pass's `sampling/*` metrics (eval mode: no update), summed over micro-batches."""
    data = data.copy()
    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    data["reference_policy_logprobs"] = data["prev_logprobs"]
    res = policy.train(data, ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)), eval_mode=True)
    return {k: sum(v) for k, v in res["all_mb_metrics"].items() if k.startswith("sampling/support")}


def test_bf16_sampling_against_fp32_training_counts_and_uses_the_recorded_support(
    policy, char_tokenizer, tiny_model_dir
) -> None:
    data = rollout(policy, char_tokenizer, "bfloat16")
    counts = support_counts(policy, data)
    assert counts["sampling/support_mismatch"] >= 1 and counts["sampling/support_unrecorded"] == 0
    n_tokens = float(data["token_mask"].sum())
    assert counts["sampling/support_mismatch_fraction"] == pytest.approx(counts["sampling/support_mismatch"] / n_tokens)

    # Previous log-probs: a float32 softmax over exactly the sampled-from set, whatever the policy's own top-k is.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    mask = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()  # [B, S]
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=mask).logits[:, :-1].float()  # [B, S-1, V]
    kept, _ = support_mask(data["generation_support"][:, 1:], logits.shape[-1])  # [B, S-1, V]
    targets = data["input_ids"][:, 1:, None]  # [B, S-1, 1]
    loss_pos = data["token_mask"][:, 1:] > 0  # [B, S-1]
    want = logits.masked_fill(~kept, float("-inf")).log_softmax(-1).gather(-1, targets)[..., 0]
    got = policy.get_logprobs(data)["logprobs"][:, 1:]  # [B, S-1]
    assert (got - want)[loss_pos].abs().max() <= 1e-5
    own_kept = logits >= logits.topk(TOP_K, dim=-1).values[..., -1:]  # the filter recomputed from these logits
    differs = (own_kept != kept).any(-1) & loss_pos  # [B, S-1]
    assert int(differs.sum()) == counts["sampling/support_mismatch"]
    # Recomputing the filter (the record dropped) changes exactly those tokens' log-probs, and no others.
    data.pop("generation_support")
    recomputed = policy.get_logprobs(data)["logprobs"][:, 1:]  # [B, S-1]
    changed = (recomputed - got).abs() > 1e-6
    assert changed[loss_pos].any() and not (changed & loss_pos & ~differs).any()


def test_fp32_on_policy_support_matches_exactly(policy, char_tokenizer) -> None:
    data = rollout(policy, char_tokenizer, "float32")
    assert data["generation_support"][..., 0].gt(0).sum() == data["token_mask"].sum()  # every sampled token recorded
    counts = support_counts(policy, data)
    assert counts == {
        "sampling/support_mismatch": 0.0,
        "sampling/support_mismatch_fraction": 0.0,
        "sampling/support_unrecorded": 0.0,
    }
    with_record = policy.get_logprobs(data)["logprobs"]
    data.pop("generation_support")
    assert torch.equal(with_record, policy.get_logprobs(data)["logprobs"])  # the same sets: the same values

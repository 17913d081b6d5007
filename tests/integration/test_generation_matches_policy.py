"""The colocated generation engine and the policy agree: greedy output equals transformers' greedy decoding, and
at temperature 1 the engine's sampled-token logprobs equal Policy.get_logprobs of the same tokens (to float32 rounding:
the compiled decode step and the packed forward add in other orders)."""

from __future__ import annotations

import torch

from relayrl.config import GenerationConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.policy.lm_policy import Policy
from tests.helpers import f32_tol


def _prompts(tokenizer, texts: list[str]) -> BatchedDataDict:
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([len(x) for x in ids]))


def test_generation_logprobs_equal_policy_logprobs(tiny_model_dir, char_tokenizer):
    policy = Policy(PolicyConfig(model_name=str(tiny_model_dir)), char_tokenizer, init_reference_model=False)
    gen_cfg = GenerationConfig(max_new_tokens=12, temperature=1.0)
    engine = HfGeneration(gen_cfg, char_tokenizer, policy.generation_source, seed=3)
    prompts = _prompts(char_tokenizer, ["<|user|>12+34=<|end|><|assistant|>", "<|user|>7-9=<|end|><|assistant|>"])
    engine.prepare_for_generation()
    out = engine.generate(prompts)
    seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    policy_lp = policy.get_logprobs(seqs)["logprobs"]  # [B, S]
    generated = out["logprobs"] != 0
    assert int(out["generation_lengths"].sum()) > 0
    # a log-prob is a logit minus the log-sum-exp over the vocabulary: n = vocabulary size, scale = the largest |lp|
    tol = f32_tol(float(policy_lp[generated].abs().max()), len(char_tokenizer))
    assert torch.allclose(out["logprobs"][generated], policy_lp[generated], atol=tol, rtol=0)

    greedy = engine.generate(prompts, greedy=True)
    model = policy.generation_source.model
    for i in range(prompts.size):
        n = int(prompts["input_lengths"][i])
        ref = model.generate(
            prompts["input_ids"][i : i + 1, :n],
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=char_tokenizer.eos_token_id,
            pad_token_id=char_tokenizer.pad_token_id,
        )[0]
        total = int(greedy["unpadded_sequence_lengths"][i])
        assert greedy["output_ids"][i, :total].tolist() == ref[:total].tolist()
    engine.shutdown()
    policy.shutdown()

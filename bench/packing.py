"""Tokens/s of the policy passes on a length-skewed batch: unpacked vs dynamic batching vs sequence packing.

Why: RL batches mix short and long samples; with fixed-row micro-batches every row's attention runs over the
micro-batch's longest row, and a micro-batch of short rows is a small, inefficient call. Dynamic batching sorts rows
by length into token-budget micro-batches; sequence packing bins whole sequences under a token capacity and runs
each bin as one packed stream with per-sequence attention. This measures the policy's own passes through the
`Policy` façade (one local worker, CPU, one thread): the log-prob pass (no grad) and one training step (GRPO's clipped
loss, forward + backward + AdamW), on a random Qwen2 built here (hidden 128, 4 layers, 4 heads / 2 KV heads,
intermediate 352, vocabulary 2048) and a batch of 64 rows: prompts of 16-512 tokens, completions of 1-256, right-
padded to the longest row. Tokens/s counts real (unpadded) tokens; the padding fraction is that of the [B, S] batch.

Each `--mbs` value is one comparison at equal memory: unpacked micro-batches of that many rows, the other two modes
with a budget of that many rows x S tokens (8: small micro-batches; 64: the whole batch in one, as relayrl's default
micro-batch sizes of 128 rows run it). The modes run interleaved, round after round, so load changes on a shared
machine hit all alike; medians over `--rounds`, and each mode's ratio to unpacked. The CPU fast path already drops
padding from every token-wise op (projections, MLP, norms, LM head), so what packing saves is attention over padding
and small calls: the gain grows with the share of attention and with the unpacked micro-batch size.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/packing.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.config import ClippedPGLossConfig, ClusterConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.policy.lm_policy import Policy

VOCAB = 2048
MODES = ("unpacked", "dynamic", "packing")
PASSES = ("logprob", "train")


def build_model(path: str) -> None:
    """The random Qwen2 the bench trains, saved as a Hugging Face directory."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)


def make_batch(rows: int, seed: int) -> BatchedDataDict:
    """Prompts of 16-512 tokens and completions of 1-256 (uniform), right-padded; the loss covers completions."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(16, 513, (rows,), generator=g)  # [B]
    completion = torch.randint(1, 257, (rows,), generator=g)  # [B]
    lengths = prompt + completion  # [B]
    seq = int(lengths.max())
    cols = torch.arange(seq)[None, :]  # [1, S]
    real = cols < lengths[:, None]  # [B, S]
    token_mask = (real & (cols >= prompt[:, None])).float()  # [B, S]
    lp = -torch.rand(rows, seq, generator=g).masked_fill(~real, 0.0)  # [B, S]
    return BatchedDataDict(
        input_ids=torch.randint(2, VOCAB, (rows, seq), generator=g).masked_fill(~real, 0),  # [B, S]
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(rows),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, seq).clone(),  # [B, S]
        prev_logprobs=lp,
        generation_logprobs=lp.clone(),
        reference_policy_logprobs=lp.clone(),
    )


def policy_for(model_dir: str, mode: str, rows: int, mbs: int, budget: int, max_len: int) -> Policy:
    keys: dict[str, Any] = dict(
        model_name=model_dir,
        train_global_batch_size=rows,
        train_micro_batch_size=mbs,
        logprob_batch_size=mbs,
        max_total_sequence_length=max_len,
        optimizer={"kwargs": {"lr": 1e-6}},
    )
    if mode == "dynamic":
        keys["dynamic_batching"] = {"enabled": True, "train_mb_tokens": budget, "logprob_mb_tokens": budget}
    elif mode == "packing":
        keys["sequence_packing"] = {"enabled": True, "train_mb_tokens": budget, "logprob_mb_tokens": budget}
    cluster = ClusterConfig(device="cpu", torch_num_threads=1)
    return Policy(PolicyConfig.model_validate(keys), None, cluster=cluster, init_reference_model=False)


def run(model_dir: str, batch: BatchedDataDict, mbs: int, rounds: int) -> dict[tuple[str, str], float]:
    """Median seconds of each (mode, pass) for micro-batches of `mbs` rows (or `mbs` x the longest row tokens)."""
    rows, seq = batch["input_ids"].shape
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
    policies = {m: policy_for(model_dir, m, rows, mbs, mbs * seq, seq) for m in MODES}
    times: dict[tuple[str, str], list[float]] = {(m, p): [] for m in MODES for p in PASSES}
    for policy in policies.values():  # warm-up: kernels built, allocator primed
        policy.get_logprobs(batch)
    for _ in range(rounds):
        for mode, policy in policies.items():
            start = time.perf_counter()
            policy.get_logprobs(batch)
            times[(mode, "logprob")].append(time.perf_counter() - start)
            start = time.perf_counter()
            policy.train(batch, loss_fn)
            times[(mode, "train")].append(time.perf_counter() - start)
    for policy in policies.values():
        policy.shutdown()
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument(
        "--mbs", default="8,64", help="rows per unpacked micro-batch, comma-separated (budget = mbs x S)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch = make_batch(args.rows, args.seed)
    lengths = batch["input_lengths"]
    rows, seq = batch["input_ids"].shape
    tokens = int(lengths.sum())
    print(f"batch: {rows} rows, lengths {int(lengths.min())}-{int(lengths.max())} (mean {tokens / rows:.0f}), ", end="")
    print(f"padded width S = {seq}, padding fraction {1 - tokens / (rows * seq):.1%}; medians of {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as model_dir:
        build_model(model_dir)
        for mbs in (int(x) for x in args.mbs.split(",")):
            median = run(model_dir, batch, mbs, args.rounds)
            print(f"\nmicro-batches of {mbs} rows / {mbs * seq} tokens")
            print(f"{'mode':<10} {'logprob tok/s':>14} {'ratio':>6} {'train tok/s':>12} {'ratio':>6}")
            for mode in MODES:
                rates = [tokens / median[(mode, p)] for p in PASSES]
                base = [tokens / median[("unpacked", p)] for p in PASSES]
                print(
                    f"{mode:<10} {rates[0]:>14.0f} {rates[0] / base[0]:>5.2f}x {rates[1]:>12.0f} {rates[1] / base[1]:>5.2f}x"
                )


if __name__ == "__main__":
    main()

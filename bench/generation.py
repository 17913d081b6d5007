"""Micro-benchmark: relayrl's HfGeneration vs transformers `model.generate` on the same tiny model and settings.

Default workload = one GRPO rollout of the CPU anchor (reference/peers.md section B): 8 prompts x 4 samples = 32 rows,
ragged prompts of ~10 tokens, 64 new tokens, temperature 1, random Qwen2 (hidden 128, 2 layers, 4 heads,
intermediate 512, tied embeddings), 1 torch thread. Stop tokens are off by default so both engines do exactly
32 x 64 decode positions; `--eos` turns end-of-sequence stopping on for both. The two engines alternate run by run
so load from other processes on the machine hits both alike; medians of wall time and of this thread's CPU time
are reported (CPU time is the steadier number on a shared box).

    python bench/generation.py [--rows 32] [--new-tokens 64] [--repeats 15] [--eos] [--fallback] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from relayrl.config import GenerationConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.tiny import build_char_tokenizer, build_tiny_qwen2


class _Source:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights_version = 0


def _prompts(tokenizer, rows: int, per_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ragged prompts like `12+34=?` (8-12 tokens), each repeated `per_prompt` times."""
    gen = torch.Generator().manual_seed(0)
    texts = []
    for i in range(rows // per_prompt):
        a, b = torch.randint(10, 999, (2,), generator=gen).tolist()
        texts.append(f"{a}{'+-'[i % 2]}{b}=" + "?" * (i % 3))
    encoded = [tokenizer(t)["input_ids"] for t in texts for _ in range(per_prompt)]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    return ids, torch.tensor([len(e) for e in encoded])


def _timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.thread_time()
    tokens = fn()
    return time.perf_counter() - wall, time.thread_time() - cpu, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--per-prompt", type=int, default=4, help="samples per distinct prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eos", action="store_true", help="stop rows at end-of-sequence (both engines)")
    parser.add_argument("--fallback", action="store_true", help="also time relayrl's generic HF-forward decoder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=4 * args.hidden,
        seed=0,
    )
    ids, lengths = _prompts(tokenizer, args.rows, args.per_prompt)
    stop_ids = None if args.eos else []
    engine = HfGeneration(
        GenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=stop_ids),
        tokenizer,
        _Source(model),
    )
    engine.prepare_for_generation()
    batch = BatchedDataDict(input_ids=ids, input_lengths=lengths)

    # HF generate wants left padding plus an attention mask for a ragged batch.
    width = ids.shape[1]
    left = torch.full_like(ids, tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        left[i, width - n :], mask[i, width - n :] = ids[i, :n], 1
    hf_config = transformers.GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.new_tokens,
        eos_token_id=tokenizer.eos_token_id if args.eos else None,
        pad_token_id=tokenizer.pad_token_id,
    )

    def run_relayrl() -> int:
        return int(engine.generate(batch)["generation_lengths"].sum())

    def run_hf() -> int:
        with torch.inference_mode():
            out = model.generate(left, attention_mask=mask, generation_config=hf_config)
        new = out[:, width:]
        return int((new != tokenizer.pad_token_id).sum()) if args.eos else new.numel()

    engines = {"relayrl HfGeneration": run_relayrl, "transformers generate": run_hf}
    if args.fallback:
        slow = HfGeneration(engine.config, tokenizer, _Source(model), fast_path=False)
        engines["relayrl (HF-forward fallback)"] = lambda: int(slow.generate(batch)["generation_lengths"].sum())
    load_before = os.getloadavg()[0]
    for fn in engines.values():  # warm-up
        fn()
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, fn in engines.items():
            results[name].append(_timed(fn))

    print(
        f"{args.rows} rows ({args.rows // args.per_prompt} prompts x {args.per_prompt}), prompt "
        f"{int(lengths.min())}-{int(lengths.max())} tokens, {args.new_tokens} new tokens, temperature 1, "
        f"eos stop {'on' if args.eos else 'off'}; Qwen2 hidden {args.hidden} x {args.layers} layers, "
        f"{args.threads} thread(s), fast path {engine.uses_fast_path}, {args.repeats} alternating runs"
    )
    print(f"  load average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    medians = {}
    for name, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        tokens = statistics.median(r[2] for r in runs)
        medians[name] = (wall, cpu)
        print(
            f"  {name:30s} median wall {wall * 1e3:7.1f} ms   median CPU {cpu * 1e3:7.1f} ms   "
            f"min CPU {min(r[1] for r in runs) * 1e3:7.1f} ms   {tokens / wall:7.0f} generated tok/s"
        )
    hw, hc = medians["transformers generate"]
    for name, (wall, cpu) in medians.items():
        if name != "transformers generate":
            print(f"  speed-up of {name} vs model.generate: {hw / wall:.2f}x wall, {hc / cpu:.2f}x CPU")


if __name__ == "__main__":
    main()

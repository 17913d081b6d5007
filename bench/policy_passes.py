"""CPU time of the policy's full-sequence passes: HF's backbone forward vs `fast.forward`, optionally length-bucketed.

Why: after generation, a GRPO step is two no-grad log-prob passes (policy and reference) and one training
forward+backward over the same batch; on the tiny bench model these dominate the step. This measures both passes
exactly as `PolicyWorker` runs them (backbone -> `next_token_logprobs` with the chunked head; training: a masked
token-mean of the log-probs, backward, gradients cleared), on the model and batch shape of `trl_vs_relayrl.py`:
a random Qwen2 (hidden 128, 2 layers, 4 heads, intermediate 512, tied embeddings, vocabulary 103), 32 rows of a
9-11 token prompt plus a completion whose length is geometric (the chance a random model samples <|end|>),
capped at 64 tokens, right-padded to the longest row.

Variants: `hf` (model.base_model), `fast` (fast.forward), each also with the rows sorted by length and cut into
`--buckets` micro-batches that are each trimmed to their own longest row. Variants run interleaved, round after
round, so a change in machine load hits all of them alike; CPU time (time.process_time) per call, medians.

    HF_HUB_OFFLINE=1 python bench/policy_passes.py --rounds 30
    HF_HUB_OFFLINE=1 python bench/policy_passes.py --rounds 30 --keep-heap   # glibc keeps freed memory

`--keep-heap` sets glibc's trim and mmap thresholds high, so large tensors freed by one op are reused by the next
instead of being returned to the kernel and faulted back in page by page (which otherwise costs HF's no-grad pass
~14k page faults per call here).
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import statistics
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from relayrl.models.fast.forward import fast_hidden_states, hf_hidden_states
from relayrl.models.fast.support import fast_path_unsupported
from relayrl.models.policy import logprobs as lp_ops
from relayrl.models.tiny import build_tiny_qwen2

VOCAB, ROWS, MAX_NEW = 103, 32, 64
HiddenFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def keep_heap() -> None:
    """glibc: never trim the heap top and serve allocations up to 1 GiB from the heap (no mmap/munmap per op)."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 1 << 30)):
        raise RuntimeError("mallopt refused the thresholds")


def make_batch(seed: int, eos_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, S] and lengths [B]: prompt 9-11 tokens + geometric completion capped at MAX_NEW."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(9, 12, (ROWS,), generator=gen)
    u = torch.rand(ROWS, generator=gen)
    completion = (torch.log1p(-u) / torch.log1p(torch.tensor(-eos_prob))).floor().long() + 1  # geometric, >= 1
    lengths = prompt + completion.clamp(max=MAX_NEW)
    seq = int(lengths.max())
    ids = torch.randint(2, VOCAB, (ROWS, seq), generator=gen)
    ids = ids.masked_fill(torch.arange(seq)[None, :] >= lengths[:, None], 0)
    return ids, lengths


def micro_batches(ids: torch.Tensor, lengths: torch.Tensor, buckets: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One micro-batch as given, or rows sorted by length in `buckets` groups, each cut to its own longest row."""
    if buckets <= 1:
        return [(ids, lengths)]
    order = lengths.argsort()
    out = []
    for rows in order.chunk(buckets):
        seq = int(lengths[rows].max())
        out.append((ids[rows, :seq].contiguous(), lengths[rows]))
    return out


def logprob_pass(model: PreTrainedModel, mbs: list[tuple[torch.Tensor, torch.Tensor]], hidden_fn: HiddenFn) -> None:
    """The worker's no-grad pass: hidden states, then temperature-1 next-token log-probs."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for ids, lengths in mbs:
            hidden = hidden_fn(model, ids, lengths)  # [b, s, H]
            lp_ops.next_token_logprobs(hidden, head, ids, chunk_size=lp_ops.auto_chunk_size(ids.shape[0], VOCAB))


def train_pass(model: PreTrainedModel, mbs: list[tuple[torch.Tensor, torch.Tensor]], hidden_fn: HiddenFn) -> None:
    """Forward + backward of a masked token-mean of the log-probs (the shape of every policy loss)."""
    head = model.get_output_embeddings()
    total = sum(float((lengths - 1).clamp(min=0).sum()) for _, lengths in mbs)
    for ids, lengths in mbs:
        hidden = hidden_fn(model, ids, lengths)
        lp, _ = lp_ops.next_token_logprobs(hidden, head, ids, chunk_size=lp_ops.auto_chunk_size(ids.shape[0], VOCAB))
        mask = torch.arange(ids.shape[1] - 1)[None, :] < (lengths - 1)[:, None]  # [b, s-1]
        ((lp * mask).sum() / total).backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="timed calls per variant (after one warm-up call)")
    p.add_argument("--buckets", type=int, nargs="*", default=[2, 4], help="micro-batch counts for the bucketed runs")
    p.add_argument("--eos-prob", type=float, default=1.0 / VOCAB, help="per-token chance a completion ends")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-heap", action="store_true", help="glibc keeps freed memory (see module docstring)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.keep_heap:
        keep_heap()
    model = build_tiny_qwen2(
        vocab_size=VOCAB, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=512, seed=42
    )
    assert fast_path_unsupported(model) is None
    ids, lengths = make_batch(args.seed, args.eos_prob)
    print(
        f"batch {tuple(ids.shape)}: lengths mean {lengths.float().mean():.1f}, min {int(lengths.min())}, "
        f"real tokens {int(lengths.sum())} of {ids.numel()} ({lengths.sum() / ids.numel():.0%}); 1 thread; "
        f"keep_heap={args.keep_heap}; {args.rounds} rounds"
    )
    variants: dict[str, tuple[HiddenFn, int]] = {}
    for n in [1, *args.buckets]:
        suffix = "" if n == 1 else f" x{n} buckets"
        variants["hf" + suffix] = (hf_hidden_states, n)
        variants["fast" + suffix] = (fast_hidden_states, n)
    for name, run in (("log-prob pass (no grad, eval)", logprob_pass), ("forward+backward (train)", train_pass)):
        model.train(run is train_pass)
        times: dict[str, list[float]] = {v: [] for v in variants}
        faults: dict[str, int] = dict.fromkeys(variants, 0)
        for r in range(args.rounds + 1):
            for v, (fn, n) in variants.items():
                mbs = micro_batches(ids, lengths, n)
                flt, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
                run(model, mbs, fn)
                if r:  # round 0 warms up
                    times[v].append(time.process_time() - t0)
                    faults[v] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt
        base = statistics.median(times["hf"])
        print(f"\n{name}: CPU ms per call          median      min   vs hf median   page faults/call")
        for v, xs in times.items():
            med = statistics.median(xs)
            print(f"  {v:28s} {med * 1e3:9.1f} {min(xs) * 1e3:8.1f} {med / base:14.2f} {faults[v] / args.rounds:18.0f}")


if __name__ == "__main__":
    main()

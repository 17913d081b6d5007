"""Build and warm-start the shipped tiny model (`relayrl/assets/tiny-arith`).

A ~1M-parameter Qwen2 with a character tokenizer is trained with plain supervised cross-entropy on the training
split of the arithmetic task, and stopped as soon as its greedy held-out accuracy first reaches the target band:
half-trained on purpose, so GRPO/PPO has clear headroom to show. Deterministic for a given seed.

Why lr 5e-4 at batch 128: the earlier warm start (lr 1e-3, batch 64, stopped at 0.35) had learnt addition far
better than subtraction (56% vs 16%), and the default GRPO run plateaued at 0.64 (+29 points) with subtraction
stuck near 31% (mostly the units digit after a borrow). The gentler warm start stops at 0.30 with the two operations
closer (38% vs 23%); the same default run takes it to 0.71 (+41), subtraction to ~57%.

    python scripts/make_tiny_model.py --out relayrl/assets/tiny-arith --seed 0
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
from train_step import warm_start_parser, warmup_step  # scripts/train_step.py (this script's own folder)
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from relayrl.experience import arithmetic
from relayrl.experience.arithmetic import ArithmeticProblem, all_problems, format_answer, is_correct, split_problems
from relayrl.models.tiny import build_char_tokenizer, build_tiny_qwen2, count_parameters, save_tiny_model

IGNORE = -100


def prompt_text(tokenizer: PreTrainedTokenizerFast, problem: ArithmeticProblem) -> str:
    """The chat-formatted prompt, ending with the opened assistant turn."""
    messages = [{"role": "user", "content": problem.problem}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_examples(
    tokenizer: PreTrainedTokenizerFast, problems: Sequence[ArithmeticProblem]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels; labels cover only the assistant reply and its `<|end|>`."""
    rows: list[tuple[list[int], list[int]]] = []
    for p in problems:
        messages = [{"role": "user", "content": p.problem}, {"role": "assistant", "content": format_answer(p.answer)}]
        full = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        prompt = tokenizer.encode(prompt_text(tokenizer, p), add_special_tokens=False)
        assert full[: len(prompt)] == prompt and full[-1] == tokenizer.eos_token_id
        rows.append((full, [IGNORE] * len(prompt) + full[len(prompt) :]))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # [N, T]
    attention = torch.zeros((len(rows), width), dtype=torch.long)  # [N, T]
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)  # [N, T]
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, attention, labels


@torch.no_grad()
def greedy_completions(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: Sequence[ArithmeticProblem]
) -> list[str]:
    """Greedy replies (special tokens stripped); prompts are grouped by length so no padding is needed."""
    model.eval()
    max_new = max(len(format_answer(p.answer)) for p in problems) + 4
    by_len: dict[int, list[int]] = defaultdict(list)
    encoded = [tokenizer.encode(prompt_text(tokenizer, p), add_special_tokens=False) for p in problems]
    for i, ids in enumerate(encoded):
        by_len[len(ids)].append(i)
    out: list[str] = [""] * len(problems)
    for length, idx in by_len.items():
        prompts = torch.tensor([encoded[i] for i in idx])  # [B, T]
        generated = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # [B, T + new]
        for row, i in enumerate(idx):
            out[i] = tokenizer.decode(generated[row, length:], skip_special_tokens=True)
    return out


def exact_accuracy(completions: Sequence[str], problems: Sequence[ArithmeticProblem]) -> float:
    r"""Fraction of replies that are exactly `\boxed{answer}` (cheap; used for early stopping)."""
    return sum(c == format_answer(p.answer) for c, p in zip(completions, problems, strict=True)) / len(problems)


def verified_accuracy(completions: Sequence[str], problems: Sequence[ArithmeticProblem]) -> float:
    """Fraction of replies math-verify accepts (the number reported in the model card)."""
    return sum(is_correct(c, p.answer) for c, p in zip(completions, problems, strict=True)) / len(problems)


def train(args: argparse.Namespace) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict[str, float]]:
    """Supervised warm start; stops at the first evaluation whose held-out accuracy reaches `--target-low`."""
    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer()
    train_set, val_set = split_problems(all_problems(args.min_operand, args.max_operand), args.num_val)
    input_ids, attention, labels = encode_examples(tokenizer, train_set)  # [N, T] each
    model = build_tiny_qwen2(len(tokenizer), seed=args.seed)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train_set), generator=gen)
    cursor, acc, step, start = 0, 0.0, 0, time.perf_counter()
    while step < args.max_steps:
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(train_set), generator=gen), 0
        idx = order[cursor : cursor + args.batch_size]
        cursor += args.batch_size
        width = int(attention[idx].sum(1).max())
        loss = model(
            input_ids=input_ids[idx, :width], attention_mask=attention[idx, :width], labels=labels[idx, :width]
        ).loss
        warmup_step(model, optim, loss, step, args)
        step += 1
        if step % args.eval_every == 0:
            acc = exact_accuracy(greedy_completions(model, tokenizer, val_set), val_set)
            model.train()
            print(
                f"step {step:5d}  loss {loss.item():.4f}  held-out exact {acc:.3f}  {time.perf_counter() - start:.0f}s"
            )
            if acc >= args.target_low:
                break
    model.eval()
    completions = greedy_completions(model, tokenizer, val_set)
    stats = {
        "steps": float(step),
        "seconds": time.perf_counter() - start,
        "exact": exact_accuracy(completions, val_set),
        "verified": verified_accuracy(completions, val_set),
        "format": sum(c.startswith("\\boxed{") and c.endswith("}") for c in completions) / len(val_set),
        "train_size": float(len(train_set)),
    }
    if stats["exact"] > args.target_high:
        print(f"warning: overshot the target band ({stats['exact']:.3f} > {args.target_high}); lower --eval-every")
    return model, tokenizer, stats


def model_card(args: argparse.Namespace, params: int, stats: dict[str, float]) -> str:
    """README.md for the shipped directory."""
    ops = "+ and -"
    return f"""# tiny-arith

A ~{params / 1e6:.2f}M-parameter Qwen2 (`Qwen2ForCausalLM`: hidden 128, 4 layers, 4 heads, 4 KV heads,
intermediate 512, tied embeddings) with a character-level tokenizer (one id per printable ASCII character,
plus `<pad>`=0, `<|end|>`=1 (eos), `<|user|>`, `<|assistant|>`, `<|system|>`, `<|environment|>`, `<unk>`).
Chat template: each message renders as `<|role|>content<|end|>`; the generation prompt is `<|assistant|>`.

It is relayrl's built-in model for CPU demos and tests: a deliberately **half-trained** arithmetic solver that
RL post-training (GRPO/PPO) can visibly improve in minutes.

## How it was made

Random init (seed {args.seed}), then a supervised warm start on the *training split* of the arithmetic task
(`relayrl.experience.arithmetic`: all `a{{op}}b=` with operands {args.min_operand}..{args.max_operand} and {ops};
{int(stats["train_size"])} training problems, {args.num_val} held out with `HELD_OUT_SEED={arithmetic.HELD_OUT_SEED}` and never
trained on). Each example is the user message `37+45=` and the assistant reply `\\boxed{{82}}`, rendered with
the chat template; cross-entropy only on the reply and its closing `<|end|>`. AdamW, lr {args.lr}, batch
{args.batch_size}, {args.warmup_steps} warmup steps, stopped at the first evaluation (every {args.eval_every}
steps) whose greedy held-out accuracy reached {args.target_low}.

    python scripts/make_tiny_model.py --out relayrl/assets/tiny-arith --seed {args.seed}

## Measured

- training steps: {int(stats["steps"])} ({stats["seconds"]:.0f} s on CPU, {args.threads} thread(s))
- greedy held-out accuracy ({args.num_val} problems, math-verify on `\\boxed{{N}}`): **{stats["verified"]:.1%}**
- exact-string accuracy: {stats["exact"]:.1%}; replies of the form `\\boxed{{...}}`: {stats["format"]:.1%}
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = warm_start_parser(
        __doc__.splitlines()[0], "relayrl/assets/tiny-arith", max_steps=2000, eval_every=25, target_high=0.45
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, stats = train(args)
    params = count_parameters(model)
    save_tiny_model(args.out, model, tokenizer)
    (args.out / "README.md").write_text(model_card(args, params, stats))
    print(
        f"params {params}  steps {int(stats['steps'])}  held-out verified {stats['verified']:.3f}  "
        f"exact {stats['exact']:.3f}  format {stats['format']:.3f}  -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

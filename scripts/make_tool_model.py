"""Build and warm-start the shipped tool-use model (`relayrl/assets/tiny-calc`).

The same ~1M-parameter character-level Qwen2 as `tiny-arith` (scripts/make_tiny_model.py), with the tool template
(`relayrl.models.tiny.TOOL_CHAT_TEMPLATE`), trained with supervised cross-entropy on traces of the multiplication
task (`relayrl.environments.calculator`) that call the tool: the prompt `37*45=` (tools rendered by the template),
the reply `<tool_call>{"name":"multiply","arguments":{"a":37,"b":45}}</tool_call>`, the tool's `1665`, the answer
`\\boxed{1665}`. Loss on the two replies only. Training stops at the first evaluation whose greedy held-out task
success (two turns, the tool really called) reaches `--target-low`: half-trained on purpose, so GRPO has headroom
(configs/grpo_tool_multiply.yaml). Deterministic for a given seed. The copying appears abruptly (seed 0: held-out
success 7.5% at step 200, 57.5% at step 205), so evaluating every 5 steps is as fine as the stop can be.

    python scripts/make_tool_model.py --out relayrl/assets/tiny-calc --seed 0
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from train_step import warm_start_parser, warmup_step  # scripts/train_step.py (this script's own folder)
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from relayrl.environments.calculator import Calculator, final_answer
from relayrl.environments.tool_calls import parse_hermes, tool_schemas
from relayrl.experience import arithmetic
from relayrl.experience.arithmetic import ArithmeticProblem, all_problems, format_answer, split_problems
from relayrl.models.tiny import (
    TOOL_CHAT_TEMPLATE,
    build_char_tokenizer,
    build_tiny_qwen2,
    count_parameters,
    save_tiny_model,
)

IGNORE = -100
TOOLS = list(tool_schemas(Calculator).values())


def operands(problem: ArithmeticProblem) -> tuple[int, int]:
    a, b = problem.problem.rstrip("=").split("*")
    return int(a), int(b)


def trace(problem: ArithmeticProblem) -> list[dict[str, Any]]:
    """The conversation the model is taught: call the tool with the operands, answer with its result."""
    a, b = operands(problem)
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": problem.problem},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": format_answer(problem.answer)},
    ]


def render(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], prompt: bool = False) -> str:
    return str(tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=prompt))


def encode_traces(
    tokenizer: PreTrainedTokenizerFast, problems: Sequence[ArithmeticProblem]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels [N, T]; labels cover the two replies (each with its `<|end|>`).

    The character tokenizer has no merges, so the ids of a concatenation are the concatenation of the ids: each
    piece (prompt, reply, tool turn, reply) is the difference of two renderings of the conversation so far."""
    rows: list[tuple[list[int], list[int]]] = []
    for p in problems:
        messages = trace(p)
        ids: list[int] = []
        labels: list[int] = []
        done = ""
        # (conversation so far, with the generation prompt, trained?): prompt, reply 1, tool turn, reply 2
        for upto, gen_prompt, trained in ((1, True, False), (2, False, True), (3, True, False), (4, False, True)):
            text = render(tokenizer, messages[:upto], prompt=gen_prompt)
            assert text.startswith(done), "the tool template must only append"
            piece = tokenizer.encode(text[len(done) :], add_special_tokens=False)
            ids += piece
            labels += piece if trained else [IGNORE] * len(piece)
            done = text
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # [N, T]
    attention = torch.zeros((len(rows), width), dtype=torch.long)  # [N, T]
    label_ids = torch.full((len(rows), width), IGNORE, dtype=torch.long)  # [N, T]
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        label_ids[i, : len(lab)] = torch.tensor(lab)
    return input_ids, attention, label_ids


@torch.no_grad()
def _greedy(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[list[int]], max_new: int):
    """Greedy replies (ids up to and including `<|end|>`) of prompts grouped by length (no padding needed)."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(prompts):
        by_len[len(ids)].append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for length, idx in by_len.items():
        batch = torch.tensor([prompts[i] for i in idx])  # [B, T]
        generated = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # [B, T + new]
        for row, i in enumerate(idx):
            reply = generated[row, length:].tolist()
            out[i] = reply[: reply.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in reply else reply
    return out


def evaluate(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[ArithmeticProblem],
    tool: bool = True,
) -> dict[str, float]:
    """Greedy two-turn episodes as the rollout plays them: the first reply's call (parsed as the default `hermes`
    parser does) runs on a `Calculator`, its result goes back as a tool turn, the second reply answers. Without
    `tool` the result is withheld (the tool answers an error): what the model can do alone. Returns success (the
    last `\\boxed{}` is the product), valid-call rate (exactly one well-formed `multiply` call in the first reply)
    and the rate of calls with the right operands."""
    model.eval()
    first = [tokenizer.encode(render(tokenizer, trace(p)[:1], prompt=True), add_special_tokens=False) for p in problems]
    replies = _greedy(model, tokenizer, first, max_new=80)
    second: list[list[int]] = []
    valid = right_args = 0
    for p, prompt, reply in zip(problems, first, replies):
        text = tokenizer.decode(reply, skip_special_tokens=True)
        try:
            calls = parse_hermes(text)
        except ValueError:
            calls = []
        result = "Error: no valid multiply call"
        if len(calls) == 1 and calls[0]["name"] == "multiply":
            valid += 1
            right_args += (calls[0]["arguments"].get("a"), calls[0]["arguments"].get("b")) == operands(p)
            try:
                result = str(Calculator().multiply(**calls[0]["arguments"])) if tool else "Error: tool unavailable"
            except Exception as exc:
                result = f"Error: {type(exc).__name__}: {exc}"
        closing = "" if reply and reply[-1] == tokenizer.eos_token_id else tokenizer.eos_token
        turn = f"{closing}<|environment|>{result}<|end|><|assistant|>"
        second.append(prompt + reply + tokenizer.encode(turn, add_special_tokens=False))
    answers = _greedy(model, tokenizer, second, max_new=16)
    success = 0
    for p, reply, answer in zip(problems, replies, answers):
        text = tokenizer.decode(reply, skip_special_tokens=True) + tokenizer.decode(answer, skip_special_tokens=True)
        success += final_answer(text) == p.answer
    n = len(problems)
    return {"success": success / n, "valid_call": valid / n, "right_operands": right_args / n}


def train(args: argparse.Namespace) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict[str, Any]]:
    """Supervised warm start; stops at the first evaluation whose held-out success reaches `--target-low`."""
    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    train_set, val_set = split_problems(all_problems(args.min_operand, args.max_operand, ("*",)), args.num_val)
    input_ids, attention, labels = encode_traces(tokenizer, train_set)  # [N, T] each
    model = build_tiny_qwen2(len(tokenizer), seed=args.seed)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train_set), generator=gen)
    cursor, step, start = 0, 0, time.perf_counter()
    history: list[tuple[int, float]] = []  # (step, held-out success) of each evaluation
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
        if step % args.eval_every == 0 and step >= args.first_eval:
            stats = evaluate(model, tokenizer, val_set)
            history.append((step, stats["success"]))
            model.train()
            print(
                f"step {step:5d}  loss {loss.item():.4f}  held-out success {stats['success']:.3f}  valid call "
                f"{stats['valid_call']:.3f}  right operands {stats['right_operands']:.3f}  "
                f"{time.perf_counter() - start:.0f}s",
                flush=True,
            )
            if stats["success"] >= args.target_low:
                break
    seconds = time.perf_counter() - start
    model.eval()
    stats: dict[str, Any] = {f"tool_{k}": v for k, v in evaluate(model, tokenizer, val_set).items()}
    stats.update({f"alone_{k}": v for k, v in evaluate(model, tokenizer, val_set, tool=False).items()})
    stats.update(steps=float(step), seconds=seconds, train_size=float(len(train_set)))
    stats["history"] = ", ".join(f"{s}: {v:.1%}" for s, v in history[-4:])
    if stats["tool_success"] > args.target_high:
        print(
            f"warning: overshot the target band ({stats['tool_success']:.3f} > {args.target_high}); lower --eval-every"
        )
    return model, tokenizer, stats


def model_card(args: argparse.Namespace, params: int, stats: dict[str, Any]) -> str:
    """README.md for the shipped directory."""
    return f"""# tiny-calc

The tool-use sibling of `tiny-arith`: the same ~{params / 1e6:.2f}M-parameter Qwen2 (`Qwen2ForCausalLM`: hidden 128,
4 layers, 4 heads, 4 KV heads, intermediate 512, tied embeddings) and character-level tokenizer, with a chat
template that renders tools, tool calls and tool messages (`relayrl.models.tiny.TOOL_CHAT_TEMPLATE`):

    <|system|>multiply(a,b)<|end|><|user|>37*45=<|end|><|assistant|><tool_call>{{"name":"multiply","arguments":{{"a":37,"b":45}}}}</tool_call><|end|><|environment|>1665<|end|><|assistant|>\\boxed{{1665}}<|end|>

(the tools as one short system line; a call in the Hermes `<tool_call>` format the default parser reads; a `tool`
message as an `<|environment|>` turn). The template only appends, so rollouts feed observations token-in/token-out.

It is relayrl's model for the shipped tool-use task (`relayrl.environments.calculator`: two-digit multiplication,
which a model this size cannot do alone, with a `multiply` tool), deliberately **half-trained** so that GRPO
(`configs/grpo_tool_multiply.yaml`) can visibly improve it on a CPU.

## How it was made

Random init (seed {args.seed}), then a supervised warm start on the *training split* of the products
(`relayrl.experience.arithmetic`: all `a*b=` with operands {args.min_operand}..{args.max_operand};
{int(stats["train_size"])} training problems, {args.num_val} held out with `HELD_OUT_SEED={arithmetic.HELD_OUT_SEED}` and never
trained on). Each example is the trace above: cross-entropy on the two assistant replies (each with its closing
`<|end|>`), not on the prompt or the tool's turn. AdamW, lr {args.lr}, batch {args.batch_size}, {args.warmup_steps}
warmup steps, stopped at the first evaluation (every {args.eval_every} steps from step {args.first_eval}) whose greedy
held-out task success reached {args.target_low}. The skill appears abruptly (copying the operands, then the result:
held-out success by step {stats["history"]}), so the stop lands where it does.

    python scripts/make_tool_model.py --out relayrl/assets/tiny-calc --seed {args.seed}

## Measured (greedy, the {args.num_val} held-out problems, two turns)

- training steps: {int(stats["steps"])} ({stats["seconds"]:.0f} s wall on a shared CPU, {args.threads} thread(s))
- task success with the tool (the last `\\boxed{{N}}` is the product): **{stats["tool_success"]:.1%}**
- first replies that are one well-formed `multiply` call: {stats["tool_valid_call"]:.1%}; calls with the right
  operands: {stats["tool_right_operands"]:.1%}
- alone (the tool's result withheld: it answers an error): task success {stats["alone_success"]:.1%}
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = warm_start_parser(
        __doc__.splitlines()[0], "relayrl/assets/tiny-calc", max_steps=3000, eval_every=5, target_high=0.60
    )
    # the skill appears after ~200 steps (seed 0): evaluating earlier only costs time
    p.add_argument("--first-eval", type=int, default=180, help="no evaluation before this step (evaluating is slow)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, stats = train(args)
    params = count_parameters(model)
    save_tiny_model(args.out, model, tokenizer)
    (args.out / "README.md").write_text(model_card(args, params, stats))
    print(
        f"params {params}  steps {int(stats['steps'])}  held-out success {stats['tool_success']:.3f}  valid call "
        f"{stats['tool_valid_call']:.3f}  alone {stats['alone_success']:.3f}  -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

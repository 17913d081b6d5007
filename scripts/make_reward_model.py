"""Train the shipped arithmetic reward model (`relayrl/assets/tiny-arith-rm`): a one-label Qwen2 sequence classifier.

Positives are correct replies (`\\boxed{answer}`), negatives wrong ones (near misses, digit slips, random numbers,
malformed text) to the *training* split of the arithmetic task. Every example is rendered exactly as the
`reward_model` environment renders a rollout at scoring time with `render: concatenation` (the dataset's
chat-rendered prompt followed by the decoded reply) and scored like `RewardModelPolicy` (the `score` head at the last
real token), with a logistic loss, so the score is the log-odds that the reply is correct. The backbone starts from
the shipped policy `builtin:tiny-arith` (it already reads arithmetic: a random init learns far less in the same
three CPU minutes), the head from scratch. Deterministic per seed and step count.

    python scripts/make_reward_model.py --out relayrl/assets/tiny-arith-rm --seed 0
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from train_step import warmup_step  # scripts/train_step.py (this script's own folder)
from transformers import PreTrainedTokenizerFast, Qwen2ForSequenceClassification

from relayrl.config import RewardModelEnvConfig
from relayrl.environments.reward_model_env import RewardModelEnvironment, concatenation_renderer
from relayrl.experience import arithmetic
from relayrl.experience.arithmetic import ArithmeticProblem, all_problems, format_answer, is_correct, split_problems
from relayrl.models.tiny import build_char_tokenizer, build_tiny_qwen2, count_parameters
from relayrl.utils.paths import resolve_model_path

Example = tuple[ArithmeticProblem, str, float]  # (problem, reply text, label 1 correct / 0 wrong)
_BOXED_INT = re.compile(r"\\boxed\{(-?\d+)\}")


def wrong_reply(answer: str, rng: random.Random) -> str:
    """A reply that must score low: mostly near misses (the hard cases), some digit slips, noise and bad format."""
    value = int(answer)
    kind = rng.random()
    if kind < 0.55:  # near miss: off by a small amount or by a ten
        wrong = value + rng.choice([-20, -11, -10, -9, -3, -2, -1, 1, 2, 3, 9, 10, 11, 20])
    elif kind < 0.75:  # digit slip: one digit changed, or two swapped
        digits = list(str(abs(value)))
        i = rng.randrange(len(digits))
        if len(digits) > 1 and rng.random() < 0.5:
            j = (i + 1) % len(digits)
            digits[i], digits[j] = digits[j], digits[i]
        else:
            digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        wrong = int("".join(digits)) * (-1 if value < 0 else 1)
        if rng.random() < 0.1:
            wrong = -wrong
    elif kind < 0.9:  # any number in the task's answer range
        wrong = rng.randint(-99, 198)
    else:  # malformed: unterminated box, empty box, or noise
        return rng.choice([f"\\boxed{{{value}", "\\boxed{}", "".join(rng.choices("0123456789+-=\\{}boxed ", k=8))])
    if wrong == value:
        wrong = value + 1
    return format_answer(str(wrong))


def make_examples(
    problems: Sequence[ArithmeticProblem],
    rng: random.Random,
    policy_errors: dict[str, list[str]] | None = None,
    policy_frac: float = 0.0,
) -> list[Example]:
    """One correct and one wrong reply per problem (balanced classes, paired by prompt).

    With `policy_errors`, a `policy_frac` share of the wrong replies are mistakes the policy itself made on that
    problem (when it made any): the part of reply space RL will push the policy into.
    """
    out: list[Example] = []
    for p in problems:
        mistakes = policy_errors.get(p.problem) if policy_errors else None
        wrong = rng.choice(mistakes) if mistakes and rng.random() < policy_frac else wrong_reply(p.answer, rng)
        out.append((p, format_answer(p.answer), 1.0))
        out.append((p, wrong, 0.0))
    return out


def is_wrong(reply: str, answer: str) -> bool:
    """Cheap exact check for `\\boxed{N}` replies; math-verify (what the math environment uses) for anything else."""
    match = _BOXED_INT.fullmatch(reply)
    if match is not None:
        return int(match.group(1)) != int(answer)
    return not is_correct(reply, answer)


@torch.no_grad()
def sample_policy_errors(
    model_dir: str, tokenizer: PreTrainedTokenizerFast, problems: Sequence[ArithmeticProblem], k: int, seed: int
) -> dict[str, list[str]]:
    """Wrong replies among k temperature-1 samples of the policy per problem (problem text -> replies)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_dir), dtype=torch.float32).eval()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    errors: dict[str, list[str]] = {}
    try:
        by_len: dict[int, list[tuple[ArithmeticProblem, list[int]]]] = {}
        for p in problems:
            ids = tokenizer(conversation(tokenizer, p, "")[0]["content"], add_special_tokens=False)["input_ids"]
            by_len.setdefault(len(ids), []).append((p, ids))
        for length, rows in by_len.items():
            for start in range(0, len(rows), 64):
                chunk = rows[start : start + 64]
                prompts = torch.tensor([ids for _, ids in chunk])  # [b, P]
                out = lm.generate(
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    max_new_tokens=12,
                    num_return_sequences=k,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )  # [b * k, P + new]
                for i, row in enumerate(out):
                    p = chunk[i // k][0]
                    reply = str(tokenizer.decode(row[length:], skip_special_tokens=True))
                    if is_wrong(reply, p.answer):
                        errors.setdefault(p.problem, []).append(reply)
    finally:
        torch.random.set_rng_state(generator_state)
    return errors


def conversation(tokenizer: PreTrainedTokenizerFast, problem: ArithmeticProblem, reply: str) -> list[dict[str, str]]:
    """The message log a rollout ends with: the user message as the dataset stores it (the chat-rendered prompt,
    see `PromptDataset`), then the decoded reply (special tokens such as `<|end|>` stripped)."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.problem}], tokenize=False, add_generation_prompt=True
    )
    return [{"role": "user", "content": str(prompt)}, {"role": "assistant", "content": reply}]


def render(tokenizer: PreTrainedTokenizerFast, problem: ArithmeticProblem, reply: str) -> str:
    """The text the environment scores (render: concatenation)."""
    return concatenation_renderer(conversation(tokenizer, problem, reply))


def encode(tokenizer: PreTrainedTokenizerFast, examples: Sequence[Example]) -> tuple[torch.Tensor, ...]:
    """(input_ids [N, T] right-padded, input_lengths [N], labels [N])."""
    ids = tokenizer([render(tokenizer, p, r) for p, r, _ in examples], add_special_tokens=False)["input_ids"]
    lengths = torch.tensor([len(x) for x in ids])  # [N]
    input_ids = torch.full((len(ids), int(lengths.max())), tokenizer.pad_token_id, dtype=torch.long)  # [N, T]
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
    return input_ids, lengths, torch.tensor([y for _, _, y in examples])


def scores(model: Qwen2ForSequenceClassification, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Score head at the last real token of each row [B] (how `RewardModelPolicy.score` reads the classifier)."""
    batch, seq = input_ids.shape
    positions = torch.arange(seq)  # [T]
    hidden = model.base_model(
        input_ids=input_ids,
        attention_mask=(positions[None, :] < lengths[:, None]).long(),
        position_ids=positions.expand(batch, seq),
        use_cache=False,
    ).last_hidden_state  # [B, T, H]
    return model.score(hidden[torch.arange(batch), lengths - 1]).squeeze(-1)  # [B]


def build_model(vocab_size: int, args: argparse.Namespace) -> Qwen2ForSequenceClassification:
    """Tiny Qwen2 sizes, one label; the backbone optionally starts from a causal LM (e.g. builtin:tiny-arith)."""
    config = build_tiny_qwen2(
        vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers, intermediate_size=4 * args.hidden_size
    ).config
    if args.init_from:
        from transformers import AutoConfig, AutoModelForCausalLM

        source = resolve_model_path(args.init_from)
        config = AutoConfig.from_pretrained(source)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(args.seed)
    model = Qwen2ForSequenceClassification(config)
    if args.init_from:
        lm = AutoModelForCausalLM.from_pretrained(source)
        missing = model.model.load_state_dict(lm.model.state_dict(), strict=True)
        assert not missing.missing_keys and not missing.unexpected_keys
    return model


@torch.no_grad()
def evaluate(model: Qwen2ForSequenceClassification, sets: dict[str, tuple[torch.Tensor, ...]]) -> dict[str, float]:
    """Per held-out set: accuracy at score 0 and pairwise accuracy (the correct reply outscores the wrong one of the
    same prompt). Keys are prefixed with the set's name."""
    model.eval()
    out: dict[str, float] = {}
    for name, (input_ids, lengths, labels) in sets.items():
        s = torch.cat([scores(model, input_ids[i : i + 256], lengths[i : i + 256]) for i in range(0, len(labels), 256)])
        out[f"{name}accuracy"] = ((s > 0).float() == labels).float().mean().item()
        out[f"{name}pairwise"] = (s[0::2] > s[1::2]).float().mean().item()
    model.train()
    return out


def train(args: argparse.Namespace) -> tuple[Qwen2ForSequenceClassification, PreTrainedTokenizerFast, dict]:
    rng = random.Random(args.seed)
    tokenizer = build_char_tokenizer()
    train_set, val_set = split_problems(all_problems(), args.num_val)
    val_data = {"": encode(tokenizer, make_examples(val_set, random.Random(args.seed + 1)))}
    policy_errors: dict[str, list[str]] | None = None
    start = time.perf_counter()
    if args.policy:
        pool = rng.sample(train_set, min(args.policy_problems, len(train_set)))
        policy_errors = sample_policy_errors(args.policy, tokenizer, pool, args.policy_samples, args.seed)
        val_errors = sample_policy_errors(args.policy, tokenizer, val_set, args.policy_samples, args.seed + 2)
        with_errors = [p for p in val_set if p.problem in val_errors]
        val_examples = make_examples(with_errors, random.Random(args.seed + 3), val_errors, 1.0)
        val_data["policy_"] = encode(tokenizer, val_examples)
        print(
            f"policy mistakes: {sum(map(len, policy_errors.values()))} on {len(policy_errors)}/{len(pool)} training "
            f"problems; {len(with_errors)} held-out problems with one ({time.perf_counter() - start:.0f}s)"
        )
    model = build_model(len(tokenizer), args)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    step = 0
    while step < args.max_steps and time.perf_counter() - start < args.max_seconds:
        problems = rng.sample(train_set, args.batch_size // 2)
        input_ids, lengths, labels = encode(tokenizer, make_examples(problems, rng, policy_errors, args.policy_frac))
        loss = loss_fn(scores(model, input_ids, lengths), labels)
        warmup_step(model, optim, loss, step, args)
        step += 1
        if step % args.eval_every == 0:
            shown = "  ".join(f"{k} {v:.3f}" for k, v in evaluate(model, val_data).items())
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out {shown}  {time.perf_counter() - start:.0f}s")
    stats = evaluate(model, val_data)
    return model.eval(), tokenizer, {**stats, "steps": step, "seconds": time.perf_counter() - start}


def model_card(args: argparse.Namespace, params: int, stats: dict, env_stats: dict) -> str:
    init = f"Backbone from `{args.init_from}`, fresh head" if args.init_from else f"Random init (seed {args.seed})"
    policy = (
        f" {args.policy_frac:.0%} of the wrong replies are mistakes `{args.policy}` itself made ({args.policy_samples}"
        f" temperature-1 samples on each of {args.policy_problems} training problems); the rest are synthetic:"
        if args.policy
        else " the wrong replies are synthetic:"
    )
    on_policy = (
        f"\n- against `{args.policy}`'s own mistakes on the held-out problems: accuracy "
        f"**{stats['policy_accuracy']:.1%}**, pairwise **{stats['policy_pairwise']:.1%}**"
        if args.policy
        else ""
    )
    flags = "".join(f" --{k} {v}" for k, v in (("init-from", args.init_from), ("policy", args.policy)) if v)
    return f"""# tiny-arith-rm

A ~{params / 1e6:.2f}M-parameter one-label Qwen2 sequence classifier (`Qwen2ForSequenceClassification`,
`num_labels=1`) with relayrl's character tokenizer: a learned reward for the built-in arithmetic task. Its score is
the log-odds that the assistant's reply is the correct `\\boxed{{answer}}`.

Use it with the `reward_model` task and **`env.reward_model.render: concatenation`** (it was trained on the
dataset's chat-rendered prompt followed by the decoded reply, e.g. `<|user|>37+45=<|end|><|assistant|>\\boxed{{82}}`),
as in `configs/grpo_reward_model.yaml`. It is a weak verifier: a policy optimised against it long enough learns
its blind spots (reward hacking), which validation with the math verifier exposes.

## How it was made

{init}; trained with a logistic loss on balanced batches of {args.batch_size} replies to problems of the
*training split* (the {args.num_val} held-out problems, `HELD_OUT_SEED={arithmetic.HELD_OUT_SEED}`, are never seen): for each
problem the correct reply and one wrong reply.{policy} 55% near misses such as ±1/±10, 20% digit slips, 15% random
numbers, 10% malformed. AdamW, lr {args.lr}, {args.warmup_steps} warmup steps, {stats["steps"]} steps
({stats["seconds"]:.0f} s on CPU including sampling, {args.threads} thread(s)).

    python scripts/make_reward_model.py --out relayrl/assets/tiny-arith-rm --seed {args.seed}{flags}

## Measured on the held-out problems (one correct and one wrong reply each)

- synthetic wrong replies: accuracy at score 0 **{stats["accuracy"]:.1%}**, correct reply outscores the wrong
  one (pairwise) **{stats["pairwise"]:.1%}**{on_policy}
- through `RewardModelEnvironment` (render: concatenation), synthetic set: mean score of correct replies
  {env_stats["pos"]:.2f}, of wrong replies {env_stats["neg"]:.2f}
"""


def check_through_environment(out: Path, val_set: Sequence[ArithmeticProblem], seed: int) -> dict[str, float]:
    """Score held-out replies through the real environment: what GRPO/PPO will see, from the saved directory."""
    env = RewardModelEnvironment.from_config(RewardModelEnvConfig(model_dir=str(out), render="concatenation"))
    tokenizer = env.tokenizer
    examples = make_examples(val_set, random.Random(seed + 1))
    logs = [conversation(tokenizer, p, r) for p, r, _ in examples]
    rewards = env.step(logs, [None] * len(logs)).rewards  # [N]
    return {"pos": rewards[0::2].mean().item(), "neg": rewards[1::2].mean().item()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("relayrl/assets/tiny-arith-rm"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init-from",
        default="builtin:tiny-arith",
        help="causal LM whose backbone starts the classifier (it already reads arithmetic); 'none': random init",
    )
    p.add_argument(
        "--policy",
        default="builtin:tiny-arith",
        help="policy whose own mistakes become negatives; 'none': synthetic only",
    )
    p.add_argument("--policy-problems", type=int, default=1024, help="training problems the policy is sampled on")
    p.add_argument("--policy-samples", type=int, default=4, help="samples per problem")
    p.add_argument("--policy-frac", type=float, default=0.5, help="share of negatives taken from policy mistakes")
    p.add_argument("--hidden-size", type=int, default=128, help="random init only")
    p.add_argument("--num-layers", type=int, default=4, help="random init only")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--max-seconds", type=float, default=600.0, help="safety cap; a capped run is not reproducible")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--num-val", type=int, default=arithmetic.DEFAULT_NUM_VAL)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.init_from in ("", "none"):
        args.init_from = None
    if args.policy in ("", "none"):
        args.policy = None
    torch.set_num_threads(args.threads)
    model, tokenizer, stats = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    _, val_set = split_problems(all_problems(), args.num_val)
    env_stats = check_through_environment(args.out, val_set, args.seed)
    (args.out / "README.md").write_text(model_card(args, count_parameters(model), stats, env_stats))
    print(
        f"params {count_parameters(model)}  steps {stats['steps']}  held-out acc {stats['accuracy']:.3f}  "
        f"pairwise {stats['pairwise']:.3f}  env score pos {env_stats['pos']:.2f} neg {env_stats['neg']:.2f} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

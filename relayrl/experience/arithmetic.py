"""The built-in two-operand arithmetic task: the problems, a fixed held-out split, and the answer format.

The shipped tiny model is warm-started on the training split only, so accuracy on the held-out split measures
what RL post-training adds rather than what the warm start memorised.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Fixed so every run, script and test agrees on which problems are held out.
HELD_OUT_SEED = 20240917
DEFAULT_NUM_VAL = 200

_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class ArithmeticProblem:
    """`problem` is the prompt text (e.g. "37+45="); `answer` the exact integer as text (e.g. "82", "-33")."""

    problem: str
    answer: str


def all_problems(
    min_operand: int = 10, max_operand: int = 99, operations: Sequence[str] = ("+", "-")
) -> list[ArithmeticProblem]:
    """Every `a op b` with both operands in [min_operand, max_operand], ordered by operation, then a, then b."""
    if min_operand > max_operand:
        raise ValueError(f"min_operand ({min_operand}) must be <= max_operand ({max_operand})")
    if not operations:
        raise ValueError("operations must not be empty")
    unknown = [op for op in operations if op not in _OPS]
    if unknown:
        raise ValueError(f"unsupported operations {unknown}; choose from {sorted(_OPS)}")
    if len(set(operations)) != len(operations):
        raise ValueError(f"operations has duplicates: {list(operations)}")
    operands = range(min_operand, max_operand + 1)
    return [
        ArithmeticProblem(problem=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)))
        for op in operations
        for a in operands
        for b in operands
    ]


def split_problems(
    problems: Sequence[ArithmeticProblem], num_val: int, seed: int = HELD_OUT_SEED
) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    """Return `(train, val)`: `num_val` problems drawn by a seeded shuffle are held out, the rest train.

    Both lists keep the input order, so the split depends only on (problems, num_val, seed).
    """
    if num_val < 1:
        raise ValueError(f"num_val must be >= 1, got {num_val}")
    if num_val >= len(problems):
        raise ValueError(f"num_val ({num_val}) must be smaller than the number of problems ({len(problems)})")
    held_out = set(random.Random(seed).sample(range(len(problems)), num_val))
    train = [p for i, p in enumerate(problems) if i not in held_out]
    val = [p for i, p in enumerate(problems) if i in held_out]
    return train, val


def format_answer(answer: str) -> str:
    r"""The completion the model is taught to emit: `\boxed{answer}`, which math-verify extracts."""
    return f"\\boxed{{{answer}}}"


def is_correct(completion: str, answer: str) -> bool:
    """Whether math-verify finds `answer` in `completion` (imported lazily: math-verify is slow to import)."""
    from math_verify import parse, verify

    predicted = parse(completion)
    if not predicted:
        return False
    return bool(verify(parse(format_answer(answer)), predicted))

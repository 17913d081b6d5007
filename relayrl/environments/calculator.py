"""The shipped tool-use task: two-digit multiplication with a `multiply` tool (issue 26, item 6).

The prompts are the built-in arithmetic task's products (`data.arithmetic.operations: ["*"]`, e.g. `37*45=`), with
its fixed held-out split. A ~1M-parameter character model cannot multiply two-digit numbers on its own, but it can
copy the operands into a call, copy the tool's result into its answer, and be taught to do both reliably:

    <|assistant|><tool_call>{"name":"multiply","arguments":{"a":37,"b":45}}</tool_call><|end|>
    <|environment|>1665<|end|>
    <|assistant|>\\boxed{1665}<|end|>

`Calculator` is the environment class (`env.environment_factory=relayrl.environments.calculator:Calculator`) and
`correct_answer` the reward (`env.reward_fns=[relayrl.environments.calculator:correct_answer]`): 1 when the last
`\\boxed{N}` of the episode's replies is the product, else 0, so the mean reward on the held-out split is the task's
success rate. `relayrl/assets/tiny-calc` is the warm-started model (`scripts/make_tool_model.py`) and
`configs/grpo_tool_multiply.yaml` the run that trains it further.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class Calculator:
    """One episode of the multiplication task: a calculator whose only key is `multiply`."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # the operands of each call, for reward functions to read

    def reset(self, **row: Any) -> None:
        """Start an episode; the row (prompt, answer) adds nothing to the prompt."""
        self.calls = []

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        for name, value in (("a", a), ("b", b)):
            # JSON strings or floats would "work" in Python ("37" * 45 repeats a string): refuse them, the model sees
            # the error as the tool's result
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
        self.calls.append((a, b))
        return a * b


def final_answer(completion: str) -> str | None:
    """The content of the last `\\boxed{...}` in `completion`, stripped; None when there is none."""
    found = _BOXED.findall(completion)
    return found[-1].strip() if found else None


def correct_answer(
    prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[Any], **columns: Any
) -> list[float]:
    """1.0 where the last `\\boxed{N}` of the episode's replies is exactly the product, else 0.0."""
    return [1.0 if final_answer(c) == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]

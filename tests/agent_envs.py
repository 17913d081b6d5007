"""The user code the agent tests train with, written once: a TRL-style environment class with one tool, the parser
that reads the shipped model's `\\boxed{N}` reply as a call of that tool, a reward function reading the batch's
instances, and the overrides of a small multi-turn run.

The class is kept as source text because the tests hand it over the ways users do: executed in `__main__` (sent to
Ray by value), written to a `file.py:Class` file, or imported from a module only the driver can see.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: A class whose `check` tool compares a candidate with the row's answer; rewarded once the answer was checked.
CHECKER = '''
class Checker:
    """Checks an answer against the row's."""

    def reset(self, answer, **row):
        self.answer, self.checked = str(answer), []

    def check(self, value: str) -> str:
        """Check a candidate answer.

        Args:
            value: the candidate answer
        """
        self.checked.append(value)
        return "correct" if value == self.answer else "wrong"

    def get_reward(self) -> float:
        return 1.0 if self.answer in self.checked else 0.0
'''

_HANG = '        if value[-1:] in "13579":\n            time.sleep(4.0)\n'
#: The same class, whose calls with an odd candidate hang for 4 s: past a 1 s tool deadline.
SLOW_CHECKER = "import time\n" + CHECKER.replace("class Checker:", "class SlowChecker:").replace(
    "        self.checked.append(value)\n", "        self.checked.append(value)\n" + _HANG
)
assert _HANG in SLOW_CHECKER and "class SlowChecker:" in SLOW_CHECKER

#: A small multi-turn GRPO run: 2 prompts x 2 episodes of up to 2 turns, no validation, malformed calls penalised.
MULTI_TURN: dict[str, Any] = {
    "grpo.num_prompts_per_step": 2,
    "grpo.num_generations_per_prompt": 2,
    "policy.train_global_batch_size": 4,
    "policy.train_micro_batch_size": 4,
    "logger.progress_bar": False,
    "grpo.max_rollout_turns": 2,
    "grpo.val_at_start": False,
    "grpo.val_period": 0,
    "grpo.val_at_end": False,
    "env.tool_call_parser": "tests.agent_envs:boxed_as_call",
    "grpo.invalid_tool_call_advantage": -1.0,
}


def boxed_as_call(text: str) -> list[dict]:
    """The shipped model's `\\boxed{N}` as a call `check(value=N)`; no box, no call (the episode ends). A negative N
    is a malformed call here (counted, returned to the model as an error, penalised by invalid_tool_call_advantage)."""
    found = re.search(r"\\boxed\{([^}]*)\}", text)
    if found and found.group(1).startswith("-"):
        raise ValueError("negative")
    return [{"name": "check", "arguments": {"value": found.group(1)}}] if found else []


def checks(prompts: list, completions: list, environments: list, **columns: Any) -> list[float]:
    """A reward function reading the batch's environment instances (TRL's `environments=`)."""
    return [0.5 * len(env.checked) for env in environments]


def user_class(source: str, name: str, filename: str | Path = "<user script>") -> type:
    """The class as a user's script holds it (no importable module: cloudpickle sends it to Ray by value)."""
    namespace: dict = {}
    exec(compile(source, str(filename), "exec"), namespace)
    return namespace[name]

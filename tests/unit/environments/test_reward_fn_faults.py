"""Reward functions that misbehave: NaN is non-finite (never a silent 0), exiting is the function's failure, and a
call that never returns meets its deadline, each one line naming the function (and the row where there is one)."""

from __future__ import annotations

import math
import sys
import time

import pytest

from relayrl.environments.reward_fn_env import RewardFunctionEnvironment, RewardFunctionError


def logs(*completions: str) -> list[list[dict]]:
    return [[{"role": "user", "content": "<rendered>"}, {"role": "assistant", "content": c}] for c in completions]


def metas(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "columns": {"target": i}, "row": 10 + i} for i in range(n)]


def test_nan_stays_non_finite_and_none_counts_zero():
    def shaky(prompts, completions, target, **columns):
        return [float("nan") if t == 1 else (None if t == 2 else 1.0) for t in target]

    env = RewardFunctionEnvironment([shaky])
    out = env.step(logs("a", "b", "c"), metas(3))
    rewards = out.rewards.tolist()
    assert rewards[0] == 1.0 and math.isnan(rewards[1]) and rewards[2] == 0.0  # the trainer's guard sees the NaN
    assert math.isnan(out.metadata[1]["reward_components"]["shaky"]) and out.metadata[2]["reward_components"] == {
        "shaky": None
    }
    assert env.rollout_metrics() == {"reward/shaky": 1.0}  # neither NaN nor None enters the mean


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (lambda t: sys.exit(3), "it exited (SystemExit, code 3)"),
        (lambda t: (_ for _ in ()).throw(SystemExit("bye")), "it exited (SystemExit, code 'bye')"),
        (lambda t: (_ for _ in ()).throw(KeyboardInterrupt()), "it raised KeyboardInterrupt"),
    ],
    ids=["sys_exit", "system_exit", "keyboard_interrupt"],
)
def test_exiting_is_the_functions_failure_naming_the_row(body, expected):
    def quitter(prompts, completions, target, **columns):
        return [body(t) if t == 1 else 0.0 for t in target]

    with pytest.raises(RewardFunctionError) as info:
        RewardFunctionEnvironment([quitter]).step(logs("a", "b"), metas(2))
    assert str(info.value) == f"reward function 'quitter' failed on dataset row 11: {expected}" + (
        "; a reward function must return its values" if "exited" in expected else ""
    )


def test_a_call_past_its_deadline_names_the_function():
    def stuck(prompts, completions, **columns):
        time.sleep(60)
        return [0.0] * len(completions)

    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as info:
        RewardFunctionEnvironment([stuck], timeout_s=0.2).step(logs("a", "b"), metas(2))
    assert time.monotonic() - start < 5
    assert str(info.value) == (
        "reward function 'stuck' did not return within env.reward_timeout_s=0.2 s on a batch of 2 rows (from "
        "dataset row 10); fix it, or raise the deadline"
    )


def test_a_function_that_swallows_exceptions_still_meets_its_deadline():
    def stubborn(prompts, completions, **columns):
        while True:
            try:
                time.sleep(60)
            except Exception:  # noqa: BLE001 - the point: the deadline is not an Exception
                pass

    with pytest.raises(RewardFunctionError, match="'stubborn' did not return within"):
        RewardFunctionEnvironment([stubborn], timeout_s=0.2).step(logs("a"), metas(1))


def test_a_healthy_function_under_a_deadline_scores_as_without_one():
    def fine(prompts, completions, target, **columns):
        return [float(t) for t in target]

    with_deadline = RewardFunctionEnvironment([fine], timeout_s=5.0).step(logs("a", "b"), metas(2))
    without = RewardFunctionEnvironment([fine]).step(logs("a", "b"), metas(2))
    assert with_deadline.rewards.tolist() == without.rewards.tolist() == [0.0, 1.0]

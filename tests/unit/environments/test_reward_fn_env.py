"""TRL-style reward functions: aligned columns, weights, None, bad returns, and the failing row named."""

from __future__ import annotations

import functools

import pytest
import torch

from relayrl.environments.reward_fn_env import (
    RewardFunctionEnvironment,
    RewardFunctionError,
    load_reward_fn,
    named_reward_fns,
)


def logs(*completions: str) -> list[list[dict]]:
    return [[{"role": "user", "content": "<rendered>"}, {"role": "assistant", "content": c}] for c in completions]


def metas(*targets: object) -> list[dict]:
    return [{"prompt": f"p{i}", "columns": {"target": t, "extra": i}, "row": 10 + i} for i, t in enumerate(targets)]


def test_columns_arrive_aligned_and_rewards_are_the_weighted_sum():
    seen = {}

    def exact(prompts, completions, target, **columns):
        seen.update(prompts=prompts, completions=completions, target=target, **columns)
        return [float(c == str(t)) for c, t in zip(completions, target)]

    def length(prompts, completions, **columns):
        return [len(c) for c in completions]

    env = RewardFunctionEnvironment([exact, length], weights=[2.0, 0.5])
    out = env.step(logs("7", "12", "x"), metas(7, 11, 3))
    assert seen == {
        "prompts": ["p0", "p1", "p2"],
        "completions": ["7", "12", "x"],
        "target": [7, 11, 3],
        "extra": [0, 1, 2],
    }
    assert out.rewards.tolist() == [2.0 * 1 + 0.5 * 1, 0.5 * 2, 0.5 * 1]
    assert out.terminateds.all() and out.rewards.dtype == torch.float32
    assert env.rollout_metrics() == {"reward/exact": pytest.approx(1 / 3), "reward/length": pytest.approx(4 / 3)}
    assert env.rollout_metrics() == {}  # reset after reporting


def test_none_counts_zero_and_is_left_out_of_the_mean():
    def sparse(prompts, completions, **columns):
        return [None, 1.0, 0.0]

    env = RewardFunctionEnvironment([sparse])
    assert env.step(logs("a", "b", "c"), metas(1, 2, 3)).rewards.tolist() == [0.0, 1.0, 0.0]
    assert env.rollout_metrics() == {"reward/sparse": 0.5}


def test_a_row_missing_a_column_reads_none():
    def f(prompts, completions, target, **columns):
        return [0.0 if t is None else 1.0 for t in target]

    m = metas(1, 2)
    m[1]["columns"].pop("target")
    assert RewardFunctionEnvironment([f]).step(logs("a", "b"), m).rewards.tolist() == [1.0, 0.0]


def test_an_exception_names_the_function_and_the_dataset_row():
    def picky(prompts, completions, target, **columns):
        return [1.0 / (t - 5) for t in target]

    with pytest.raises(RewardFunctionError) as info:
        RewardFunctionEnvironment([picky]).step(logs("a", "b", "c"), metas(3, 4, 5))
    assert (
        str(info.value) == "reward function 'picky' failed on dataset row 12: ZeroDivisionError: float division by zero"
    )


@pytest.mark.parametrize(
    ("returned", "expected"),
    [([1.0], "returned 1 values for 2 completions"), (3.0, "not a list of 2 floats"), (["a", "b"], "a str ('a')")],
)
def test_unusable_returns_are_one_line(returned, expected):
    def bad(prompts, completions, **columns):
        return returned

    with pytest.raises(RewardFunctionError, match="reward function 'bad' failed on") as info:
        RewardFunctionEnvironment([bad]).step(logs("a", "b"), metas(1, 2))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_names_are_unique_and_partials_keep_their_function_name():
    def score(prompts, completions, scale=1.0, **columns):
        return [scale] * len(completions)

    names = [n for n, _ in named_reward_fns([score, functools.partial(score, scale=2.0), score])]
    assert names == ["score", "score_2", "score_3"]
    with pytest.raises(ValueError, match="is not callable"):
        named_reward_fns(["score"])


def test_weights_must_match_the_functions():
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        RewardFunctionEnvironment([lambda p, c, **k: [0.0] * len(c)], weights=[1.0, 2.0])


def test_load_by_module_path_and_by_file(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(
        "def f(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("user_rewards:f")([""], ["x"]) == [1.0]
    assert load_reward_fn(f"{tmp_path / 'user_rewards.py'}:f")([""], ["x"]) == [1.0]
    for entry, message in [
        ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
        ("user_rewards:g", "has no function 'g'"),
        ("missing.py:f", "does not exist"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_reward_fn(entry)

"""The rollout side of the flight recorder: per-sample rows from message logs, kept by key until recorded."""

from __future__ import annotations

import json

import pytest
import torch

from relayrl.experience.flight_recorder import ROW_COLUMNS, RolloutStash, rollout_rows


def _logs() -> list[list[dict]]:
    return [
        [
            {"role": "user", "content": f"{i}+1=", "token_ids": torch.tensor([1, 2])},
            {"role": "assistant", "content": f"\\boxed{{{i + 1}}}", "token_ids": torch.tensor([3, 4, 5])},
            {"role": "environment", "content": "ok", "token_ids": torch.tensor([6])},
        ]
        for i in range(3)
    ]


def _rows() -> dict[str, list]:
    return rollout_rows(
        _logs(),
        env_reward=torch.tensor([1.0, 0.0, 0.5]),
        loss_multiplier=torch.tensor([1.0, 1.0, 0.0]),
        truncated=torch.tensor([False, True, False]),
        prompt_lengths=torch.tensor([2, 2, 2]),
        prompt_group=torch.tensor([7, 7, 9]),
        task_names=["math"] * 3,
        env_metadata=[{"ground_truth": "1"}, None, {"ground_truth": "3"}],
    )


def test_rollout_rows_take_text_rewards_and_metadata_per_row():
    rows = _rows()
    assert list(rows) == list(ROW_COLUMNS)
    assert rows["prompt"] == ["0+1=", "1+1=", "2+1="]
    assert rows["completion"] == ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"]  # assistant turns only
    assert rows["reward_env"] == [1.0, 0.0, 0.5] and rows["truncated"] == [False, True, False]
    assert rows["response_token_length"] == [3, 3, 3] and rows["prompt_group"] == [7, 7, 9]
    assert [json.loads(m) for m in rows["env_metadata"]] == [{"ground_truth": "1"}, None, {"ground_truth": "3"}]


def test_stash_returns_rows_in_the_order_asked_and_names_missing_keys():
    stash = RolloutStash()
    stash.add("train", ["a_g0", "a_g1", "b_g0"], _rows(), reset=True)
    taken = stash.take(["b_g0", "a_g0"])
    assert taken["prompt"] == ["2+1=", "0+1="] and taken["loss_multiplier"] == [0.0, 1.0]
    with pytest.raises(KeyError, match="no rollout rows for 1 key"):
        stash.take(["a_g1", "zz_g3"])
    with pytest.raises(KeyError):  # taken rows leave the stash
        stash.take(["a_g0"])
    stash.add("train", ["c_g0", "c_g1", "c_g2"], _rows(), reset=True)  # a new step's first rollout resets
    with pytest.raises(KeyError):
        stash.take(["a_g1"])


def test_stash_keeps_the_newest_partitions_for_batches_in_flight():
    """The async producer writes batch k+1 while step k records: both partitions live, the oldest beyond
    `keep_partitions` goes."""
    stash = RolloutStash(keep_partitions=2)
    stash.add("train_b1", ["a_g0", "a_g1", "a_g2"], _rows(), reset=True)
    stash.add("train_b2", ["b_g0", "b_g1", "b_g2"], _rows(), reset=True)
    assert stash.take(["a_g1"])["prompt"] == ["1+1="]  # batch 1 survives batch 2's reset
    stash.add("train_b3", ["c_g0", "c_g1", "c_g2"], _rows(), reset=True)
    with pytest.raises(KeyError):
        stash.take(["a_g0"])  # batch 1 fell out: only the newest two are kept
    assert stash.take(["b_g0", "c_g2"])["prompt"] == ["0+1=", "2+1="]

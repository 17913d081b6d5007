"""A new user's TRL-style environment class (one tool, `reset`, `get_reward`) trains 3 steps on the shipped model,
from `relayrl.train` and from the CLI, on the data-plane trainer (the default) and the legacy one (issue 26).

The shipped model answers `\\boxed{N}` and knows no tool-call format, so these runs read that answer as a call of
the class's `check` tool (`env.tool_call_parser`, the pluggable parser): every first turn calls the tool, the
tool's answer is appended as a `tool` message through the chat template, and the model answers again. What is
asserted is the mechanism: the tool ran, its message is in the trained sequence and masked out of the loss, the
counts and rewards are logged, and both trainers log the same numbers.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import relayrl
from relayrl.cli.main import main
from tests.agent_envs import CHECKER, MULTI_TURN, checks, user_class
from tests.helpers import assert_breakdown_adds_up, metrics_by_step

SMALL = {**MULTI_TURN, "grpo.max_num_steps": 3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same user code run twice: from `relayrl.train` on the data-plane trainer (the default), and from the CLI
    (class and reward function by import path) on the legacy trainer."""
    root = tmp_path_factory.mktemp("agents")
    result = relayrl.train(
        environment_factory=user_class(CHECKER, "Checker", root / "checker.py"),
        reward_fns=[checks],
        run_dir=root / "api",
        overrides=SMALL,
    )
    (root / "checker.py").write_text(CHECKER)
    sys.modules.pop("relayrl_reward_checker", None)
    argv = ["train", "--run-dir", str(root / "cli"), f"env.environment_factory={root / 'checker.py'}:Checker"]
    argv += ["env.reward_fns=[tests.agent_envs:checks]", "data_plane.enabled=false"]
    assert main(argv + [f"{k}={v}" for k, v in SMALL.items()]) == 0
    return {"api": result.run_dir, "cli": root / "cli"}


def test_environment_class_trains_3_steps_from_the_python_api(runs, char_tokenizer) -> None:
    steps = metrics_by_step(runs["api"], skip=("per_sec", "latency", "timing"))
    assert sorted(steps) == [1, 2, 3]
    for m in steps.values():
        assert m["train/env/episodes"] == 4
        assert m["train/env/tool_errors"] == 0 and m["train/env/tool_timeouts"] == 0
        # every second turn follows a call (valid or not) in the first
        calls = m["train/env/tool_calls"] + m["train/env/invalid_tool_calls"]
        assert 1.0 <= m["train/avg_turns_per_sample"] <= 2.0 and calls >= 4 * (m["train/avg_turns_per_sample"] - 1)
    assert sum(m["train/env/tool_calls"] for m in steps.values()) > 0  # the tool ran
    for run in runs.values():  # tool calls and episode resets are the `environment` phase, on both trainers
        assert assert_breakdown_adds_up(run, timed=("generation", "environment")) == 3
    assert sum(m["train/env/invalid_tool_calls"] for m in steps.values()) > 0  # malformed calls were counted
    marker = char_tokenizer("<|tool|>", add_special_tokens=False)[
        "input_ids"
    ]  # a tool turn, as the template renders it
    rows = []
    for step in (1, 2, 3):
        rows += pq.read_table(runs["api"] / "rollouts" / f"step_{step:06d}.parquet").to_pylist()
    seen = set()
    for row in rows:
        n = row["input_lengths"]
        ids, mask = row["input_ids"][:n], row["token_mask"][:n]
        parts = json.loads(row["env_metadata"])["reward_components"]
        assert row["reward_env"] == pytest.approx(parts["get_reward"] + parts["checks"])  # get_reward + functions
        at = [k for k in range(n) if ids[k : k + len(marker)] == marker]
        if not at:
            continue
        # the tool's answer is in the trained sequence, out of the loss, between two trained replies
        end = at[0] + mask[at[0] :].index(1)
        text = char_tokenizer.decode(ids[at[0] : end], skip_special_tokens=False)
        found = re.fullmatch(r"<\|tool\|>(correct|wrong|Error: negative)<\|end\|><\|assistant\|>", text)
        assert found, text
        assert mask[at[0] - 1] == 1 and set(mask[at[0] : end]) == {0} and mask[end] == 1
        seen.add(found.group(1)[:5])
        advantages = row["advantages"]
        if found.group(1).startswith("Error"):  # the malformed call's reply carries the penalty, token by token
            first_reply = [k for k in range(at[0]) if mask[k]]
            assert [advantages[k] for k in first_reply] == [-1.0] * len(first_reply)
        else:
            assert parts["checks"] == 0.5
    assert "Error" in seen and seen & {"corre", "wrong"}


def test_the_cli_on_the_legacy_trainer_logs_the_same_numbers(runs) -> None:
    keys = ("train/reward", "train/loss", "train/grad_norm", "train/total_num_tokens", "train/env/tool_calls")
    keys += ("train/env/episodes", "train/env/invalid_tool_calls", "train/advantages/mean", "train/advantages/min")
    keys += ("train/reward/checks",)
    a = metrics_by_step(runs["api"])
    b = metrics_by_step(runs["cli"])
    assert sorted(a) == sorted(b) == [1, 2, 3]  # 3 steps each
    for step in (1, 2, 3):
        assert {k: a[step][k] for k in keys} == {k: b[step][k] for k in keys}


def test_a_failing_reset_ends_the_cli_run_with_one_line(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "bad_env.py").write_text(
        CHECKER.replace("Checker", "Picky").replace(
            "self.answer, self.checked = str(answer), []",
            "self.answer, self.checked = str(1 // (int(answer) - 50)), []",
        )
    )
    data = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(45, 53)]  # answer 50 divides by zero: row 5
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--run-dir", "run", "env.environment_factory=bad_env.py:Picky", "data.shuffle=false"]
    argv += ["data.train.source=file", "data.train.path=data.jsonl"]
    argv += [f"{k}={v}" for k, v in SMALL.items()]
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("relayrl")]
    assert len(err) == 1, err
    assert "environment class Picky.reset failed on dataset row 5: ZeroDivisionError: integer division" in err[0]


def test_recorded_turns_are_inspected_and_exported_as_chat_messages(runs, tmp_path, capsys) -> None:
    """`relayrl inspect` prints a multi-turn sample turn by turn; `relayrl export-rollouts` writes the step's
    conversations as OpenAI-style chat messages with tool calls; bad input is one line, exit 2."""
    run = runs["api"]
    table = pq.read_table(run / "rollouts" / "step_000001.parquet").to_pylist()
    out = tmp_path / "step1.jsonl"
    assert main(["export-rollouts", str(run), "--step", "1", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["sample_key"] for x in lines] == [r["sample_key"] for r in table]
    assert [x["reward"] for x in lines] == [r["reward_env"] for r in table]
    called = 0
    for line, row in zip(lines, table):
        messages = line["messages"]
        assert messages[0]["role"] == "user" and messages[1]["role"] == "assistant"
        for k, m in enumerate(messages):
            for c in m.get("tool_calls") or []:  # a call the tool ran: its result follows, naming the tool
                value = json.loads(c["function"]["arguments"])["value"]
                assert c["function"]["name"] == "check" and f"\\boxed{{{value}}}" in m["content"]
                result = messages[k + 1]
                assert result["role"] == "tool" and result["tool_call_id"] == c["id"] and result["name"] == "check"
                assert result["content"] in ("correct", "wrong")
                called += 1
        assert "".join(m["content"] for m in messages if m["role"] == "assistant") == row["completion"]
    assert called == sum(len(json.loads(r["tool_latency_s"])) for r in table) > 0
    capsys.readouterr()
    assert main(["inspect", str(run), "--step", "1"]) == 0
    printed = capsys.readouterr().out
    assert "conversation:" in printed and re.search(r"call check\(\{\"value\": \"\d+\"\}\)", printed)
    assert re.search(r"check -> (correct|wrong)", printed)
    for argv, problem in (
        ([str(tmp_path / "nope"), "--step", "1"], "run directory does not exist"),
        ([str(run), "--step", "99"], "no flight recording of step 99"),
    ):
        assert main(["export-rollouts", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and problem in err[0], err

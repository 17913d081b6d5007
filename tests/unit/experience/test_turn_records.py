"""The flight recorder's turns of a multi-turn tool rollout (issue 26 item 5): per message its role, token span,
text, the assistant's tool calls and the tool turn's results, and their export as OpenAI-style chat messages."""

from __future__ import annotations

import json

import torch

from relayrl.cli.export_rollouts import chat_messages
from relayrl.environments.tool_env import ToolEnvironment
from relayrl.experience.flight_recorder import ROW_COLUMNS, RolloutStash, import_rows, rollout_rows
from relayrl.experience.rollouts import run_multi_turn_rollout
from relayrl.experience.sync_rollout_actor import flatten_for_store
from tests.unit.experience.test_tool_rollouts import Notebook, ScriptedTurns, batch_for, call, chars
from tests.unit.experience.test_tool_rollouts import merging_tokenizer as merging_tokenizer  # noqa: F401 (fixture)


def _recorded(tok) -> tuple[dict, dict]:
    eos = tok.eos_token_id
    script = [
        [chars(tok, call("ab")) + [eos], chars(tok, "done") + [eos]],  # a call, then an answer
        [chars(tok, "<tool_call>{bad</tool_call>") + [eos], chars(tok, "ab") + [eos]],  # a malformed call
    ]
    final, _ = run_multi_turn_rollout(
        ScriptedTurns(script), batch_for(tok, ["ab", "ab"]), tok, {"environment": ToolEnvironment(Notebook)}, 1024, 2
    )
    rows = rollout_rows(
        final["message_log"],
        final["total_reward"],
        torch.ones(2),
        final["truncated"],
        final["length"],
        torch.tensor([0, 1]),
        final["task_name"],
        final["extra_env_info"],
    )
    return final, rows


def test_each_turn_is_recorded_with_its_span_calls_and_results(merging_tokenizer) -> None:  # noqa: F811
    final, rows = _recorded(merging_tokenizer)
    assert list(rows) == list(ROW_COLUMNS)
    flat = flatten_for_store(final["message_log"], merging_tokenizer.pad_token_id, 1)
    turns = [json.loads(t) for t in rows["turns"]]
    for r, records in enumerate(turns):
        assert [t["role"] for t in records] == ["user", "assistant", "tool", "assistant", "environment"]
        spans = [(t["start"], t["end"]) for t in records]  # contiguous, covering the whole sequence
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] == int(flat["input_lengths"][r])
        ids = flat["input_ids"][r].tolist()
        assert ids[spans[1][0] : spans[1][1]] == final["message_log"][r][1]["token_ids"].tolist()  # the reply's ids
        assert records[0]["messages"] == [{"role": "user", "content": f"q{r}\n\nWrite it down."}]
    ok, bad = turns
    assert ok[1]["tool_calls"] == [{"name": "write", "arguments": {"text": "ab"}}]
    assert ok[2]["results"] == [{"name": "write", "content": "noted ab", "status": "ok"}]
    assert ok[3]["content"] == "done" and "tool_calls" not in ok[3]
    assert bad[1]["flags"] == {"is_invalid_tool_call": True} and "tool_calls" not in bad[1]
    assert bad[2]["messages"][0]["content"].startswith("Error: tool call is not valid JSON") and "results" not in bad[2]
    latencies = [json.loads(x) for x in rows["tool_latency_s"]]  # timings apart: `turns` is equal in equal runs
    assert len(latencies[0]) == 1 and 0.0 <= latencies[0][0] < 5.0 and latencies[1] == []
    assert "latency" not in rows["turns"][0]


def test_export_gives_openai_chat_messages_with_tool_calls(merging_tokenizer) -> None:  # noqa: F811
    _, rows = _recorded(merging_tokenizer)
    ok, bad = (chat_messages(json.loads(t), r) for r, t in enumerate(rows["turns"]))
    assert ok == [
        {"role": "user", "content": "q0\n\nWrite it down."},
        {
            "role": "assistant",
            "content": call("ab"),
            "tool_calls": [
                {"id": "call_0_1_0", "type": "function", "function": {"name": "write", "arguments": '{"text": "ab"}'}}
            ],
        },
        {"role": "tool", "content": "noted ab", "name": "write", "tool_call_id": "call_0_1_0"},
        {"role": "assistant", "content": "done"},
    ]  # the final environment observation is empty text: not a message
    assert [m["role"] for m in bad] == ["user", "assistant", "tool", "assistant"]
    assert "tool_calls" not in bad[1] and "tool_call_id" not in bad[2] and bad[2]["content"].startswith("Error:")


def test_rows_of_an_older_checkpoint_get_empty_turns() -> None:
    stash = RolloutStash()
    old = {"a_g0": [0, "math", "1+1=", "2", 1.0, 1.0, False, 4, 1, "null"]}  # the ten columns before turns
    import_rows(stash, {"train": old})
    taken = stash.take(["a_g0"])
    assert taken["turns"] == ["[]"] and taken["tool_latency_s"] == ["[]"] and taken["completion"] == ["2"]

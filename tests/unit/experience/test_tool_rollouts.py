"""Multi-turn tool rollouts of an environment class through the one rollout loop: token-in/token-out (issue 26
item 2), masks, per-turn log-probs, tool execution, counts, episode ends and routing of several classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.tool_env import ToolEnvironment
from relayrl.experience.rollouts import (
    batched_message_log_to_flat_message,
    build_message_advantage_overrides,
    run_multi_turn_rollout,
)
from relayrl.experience.sync_rollout_actor import flatten_for_store
from tests.helpers import ScriptedGenerationBase, scripted_generation_output

TINY = Path(__file__).resolve().parents[3] / "relayrl" / "assets" / "tiny-arith"
#: The shipped template, with the tool schemas rendered into a system turn when given.
TEMPLATE = (
    "{% if tools %}{{ '<|system|>' + (tools | tojson) + '<|end|>' }}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.fixture(scope="module")
def merging_tokenizer() -> Any:
    """The shipped character-level tokenizer plus one BPE merge (`a` `b` -> `ab`) and a `<|tool|>` token: a reply
    the engine spells `a`, `b` decodes to text that re-tokenises to the single `ab`, so re-tokenising the history
    changes the ids (what token-in/token-out must never do)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((TINY / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["ab"] = len(vocab)
    spec["model"]["merges"] = [["a", "b"]]
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.add_special_tokens([AddedToken("<|tool|>", special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>", pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    return tok


class Notebook:
    """Keeps notes; the reward is whether the answer was written down."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.answer = ""

    def reset(self, answer: str) -> str:
        self.answer = answer
        return "Write it down."

    def write(self, text: str) -> str:
        """Write a note.

        Args:
            text: what to write
        """
        self.notes.append(text)
        return f"noted {text}"

    def get_reward(self) -> float:
        return 1.0 if self.answer in self.notes else 0.0


def chars(tok: Any, text: str) -> list[int]:
    """`text` one id per character (the engine's choice; never the merged `ab`)."""
    return [tok.convert_tokens_to_ids("Ġ" if c == " " else c) for c in text]


def call(text: str) -> str:
    return '<tool_call>{"name": "write", "arguments": {"text": "' + text + '"}}</tool_call>'


class ScriptedTurns(ScriptedGenerationBase):
    """Row r's reply at turn t is `script[r][t]` (ids); rows are matched by their position among active rows."""

    def __init__(self, script: list[list[list[int]]]) -> None:
        self.script, self.turn, self.inputs = script, 0, []
        self.active = list(range(len(script)))

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        self.inputs.append([row[:n].tolist() for row, n in zip(data["input_ids"], data["input_lengths"].tolist())])
        replies = [self.script[r][self.turn] for r in self.active]
        self.turn += 1
        self.active = [r for r in self.active if self.turn < len(self.script[r])]
        out = scripted_generation_output(
            data, replies, [False] * len(replies), pad_id=0, logprobs=lambda n: -0.01 * torch.arange(1, n + 1)
        )
        return out


def batch_for(
    tok: Any, answers: list[str], task: str = "environment", tasks: list[str] | None = None
) -> BatchedDataDict:
    logs, infos = [], []
    for k, answer in enumerate(answers):
        messages = [{"role": "user", "content": f"q{k}"}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        logs.append([{"role": "user", "content": text, "token_ids": torch.tensor(tok(text)["input_ids"])}])
        infos.append({"messages": messages, "columns": {"answer": answer}, "row": k + 1, "prompt": f"q{k}"})
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=infos,
        task_name=tasks or [task] * len(answers),
        loss_multiplier=torch.ones(len(answers)),
        length=torch.tensor([len(m[0]["token_ids"]) for m in logs]),
    )


def test_trained_ids_are_engine_ids_plus_templated_observations(merging_tokenizer) -> None:
    tok = merging_tokenizer
    eos = tok.eos_token_id
    script = [
        [chars(tok, call("ab")) + [eos], chars(tok, "done") + [eos]],  # tool call, then an answer
        [chars(tok, call("cab")), chars(tok, "ok") + [eos]],  # a call the engine did not close with eos
        [chars(tok, "<tool_call>{bad</tool_call>") + [eos], chars(tok, "ab") + [eos]],  # malformed
        [chars(tok, call("x")) + [eos], chars(tok, call("ab")) + [eos]],  # still calling at the turn limit
    ]
    env = ToolEnvironment(Notebook)
    engine = ScriptedTurns(script)
    final, metrics = run_multi_turn_rollout(
        engine,
        batch_for(tok, ["ab", "zz", "ab", "ab"]),
        tok,
        {"environment": env},
        max_seq_len=1024,
        max_rollout_turns=2,
    )
    schema = json.dumps([env.schemas["write"]])  # the template's tojson (same separators as json.dumps)
    assert "write" in schema and "Args" not in schema
    flat = flatten_for_store(final["message_log"], tok.pad_token_id, 1)
    results = [f"noted {'ab'}", f"noted {'cab'}", None, "noted x"]
    for r, replies in enumerate(script):
        prompt = f"<|system|>{schema}<|end|><|user|>q{r}\n\nWrite it down.<|end|><|assistant|>"
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        if results[r] is None:
            obs_text = "<|tool|>Error: tool call is not valid JSON (Expecting property name enclosed in double quotes)"
        else:
            obs_text = f"<|tool|>{results[r]}"
        closing = "" if replies[0][-1] == eos else "<|end|>"  # the end of turn the engine did not generate
        obs_ids = tok(f"{closing}{obs_text}<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
        expected = prompt_ids + replies[0] + obs_ids + replies[1]
        n = int(flat["input_lengths"][r])
        got = flat["input_ids"][r, :n].tolist()
        assert got == expected, r
        # the engine was fed exactly this history at turn 2 (nothing decoded and re-tokenised in between)
        assert engine.inputs[1][r] == prompt_ids + replies[0] + obs_ids
        # re-tokenising the decoded sequence gives other ids: the test would fail on a re-tokenising rollout
        assert tok(tok.decode(got), add_special_tokens=False)["input_ids"] != got
        mask = flat["token_mask"][r, :n].tolist()
        ones = [0] * len(prompt_ids) + [1] * len(replies[0]) + [0] * len(obs_ids) + [1] * len(replies[1])
        assert mask == ones  # loss only on the engine's tokens; prompt, tool and environment tokens masked
        lp = flat["generation_logprobs"][r, :n]
        second = len(prompt_ids) + len(replies[0]) + len(obs_ids)
        assert torch.allclose(lp[second : second + len(replies[1])], -0.01 * torch.arange(1, len(replies[1]) + 1))
        assert torch.equal(lp[torch.tensor(ones) == 0], torch.zeros(len(ones) - sum(ones)))
    # rewards: get_reward at the episode's end (row 1 wrote "cab", not "zz"; row 3 was stopped by the turn limit)
    assert final["total_reward"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert final["message_log"][2][1]["flags"] == {"is_invalid_tool_call": True}
    assert [m["role"] for m in final["message_log"][0]] == ["user", "assistant", "tool", "assistant", "environment"]
    assert final["message_log"][0][2]["messages"] == [{"role": "tool", "name": "write", "content": "noted ab"}]
    assert final["length"].tolist() == [len(final["message_log"][r][0]["token_ids"]) for r in range(4)]
    assert metrics["env/tool_calls"] == 4 and metrics["env/invalid_tool_calls"] == 1
    assert metrics["env/tool_errors"] == 0 and metrics["env/episodes"] == 4
    assert metrics["max_turns_reached_rate"] == 0.25
    assert not env._episodes  # every instance released
    # the malformed call's reply is what grpo.invalid_tool_call_advantage overrides (the legacy trainer's path)
    assert build_message_advantage_overrides(final["message_log"], {"is_invalid_tool_call": -1.0}) == {
        "is_invalid_tool_call": 1
    }
    override = batched_message_log_to_flat_message(final["message_log"], {"token_ids": 0})[0]["advantage_override"]
    penalised = (override == -1.0).nonzero().tolist()  # [[row, column], ...]
    first_reply = len(final["message_log"][2][0]["token_ids"])
    assert penalised == [[2, first_reply + k] for k in range(len(script[2][0]))]


class Other(Notebook):
    """Same tools, another class: rows are routed by task name."""

    def get_reward(self) -> float:
        return 5.0


def test_several_classes_are_routed_by_task_with_metrics_each(merging_tokenizer) -> None:
    tok = merging_tokenizer
    eos = tok.eos_token_id
    envs = {
        "notes": ToolEnvironment(Notebook, metric_prefix="env/notes"),
        "other": ToolEnvironment(Other, metric_prefix="env/other"),
    }
    script = [[chars(tok, call("ab")) + [eos], chars(tok, "ok") + [eos]], [chars(tok, "ok") + [eos]]]
    final, metrics = run_multi_turn_rollout(
        ScriptedTurns(script), batch_for(tok, ["ab", "ab"], tasks=["notes", "other"]), tok, envs, 1024, 2
    )
    assert final["total_reward"].tolist() == [1.0, 5.0]
    assert metrics["env/notes/tool_calls"] == 1 and metrics["env/other/tool_calls"] == 0
    assert metrics["env/notes/episodes"] == 1 and metrics["env/other/episodes"] == 1


class NoReset:
    """No reset: every episode starts from the dataset's prompt as it is."""

    def __init__(self) -> None:
        self.calls = 0

    def write(self, text: str) -> str:
        """Write a note.

        Args:
            text: what to write
        """
        self.calls += 1
        return "a very long answer from the tool " * 4

    def get_reward(self) -> float:
        return float(self.calls)


def test_an_episode_cut_by_the_sequence_budget_is_scored_by_its_environment(merging_tokenizer) -> None:
    tok = merging_tokenizer
    script = [[chars(tok, call("ab")) + [tok.eos_token_id]]]
    env = ToolEnvironment(NoReset)
    batch = batch_for(tok, ["ab"])
    budget = len(batch["message_log"][0][0]["token_ids"]) + len(script[0][0]) + 20 + len(json.dumps([env.tools]))
    final, metrics = run_multi_turn_rollout(ScriptedTurns(script), batch, tok, {"environment": env}, budget, 5)
    log = final["message_log"][0]
    assert log[0]["content"].endswith("<|user|>q0<|end|><|assistant|>")  # no reset: the prompt as given
    assert sum(len(m["token_ids"]) for m in log) == budget  # the tool's long answer was cut at the budget
    assert final["truncated"].tolist() == [True] and final["total_reward"].tolist() == [1.0]  # get_reward at the end
    assert metrics["natural_termination_rate"] == 0.0 and not env._episodes

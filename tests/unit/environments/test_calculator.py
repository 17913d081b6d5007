"""The shipped tool-use task (issue 26, item 6): the `Calculator` class, its reward, the shipped model's template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from relayrl.environments.calculator import Calculator, correct_answer, final_answer
from relayrl.environments.tool_calls import parse_hermes, tool_schemas
from relayrl.experience.arithmetic import all_problems, split_problems
from relayrl.experience.chat_render import ChatRenderer
from relayrl.utils.paths import resolve_model_path

TRACE = (
    '<|system|>multiply(a,b)<|end|><|user|>37*45=<|end|><|assistant|><tool_call>{"name":"multiply","arguments":'
    '{"a":37,"b":45}}</tool_call><|end|><|environment|>1665<|end|><|assistant|>\\boxed{1665}<|end|>'
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-calc"))


def test_multiply_is_the_one_tool_and_refuses_what_is_not_an_integer() -> None:
    schemas = tool_schemas(Calculator)
    assert list(schemas) == ["multiply"]
    assert schemas["multiply"]["function"]["parameters"]["required"] == ["a", "b"]
    env = Calculator()
    env.reset(prompt="37*45=", answer="1665")
    assert env.multiply(a=37, b=45) == 1665 and env.calls == [(37, 45)]
    for bad in ("37", 3.5, True):  # "37" * 45 would repeat the string: refused, the model reads the error
        with pytest.raises(TypeError, match="a must be an integer"):
            env.multiply(a=bad, b=45)
    env.reset()
    assert env.calls == []


def test_correct_answer_reads_the_last_box_of_the_episode() -> None:
    call = '<tool_call>{"name":"multiply","arguments":{"a":37,"b":45}}</tool_call>'
    completions = [call + "\\boxed{1665}", call + "\\boxed{1666}", "\\boxed{12}\\boxed{1665}", call, "\\boxed{ 1665 }"]
    assert correct_answer([None] * 5, completions, ["1665"] * 5) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert final_answer("no box") is None


def test_the_products_have_a_fixed_held_out_split() -> None:
    problems = all_problems(10, 99, ("*",))
    train, val = split_problems(problems, 200)
    assert (len(problems), len(train), len(val)) == (8100, 7900, 200)
    assert val[0].problem.endswith("=") and "*" in val[0].problem and int(val[0].answer) > 0
    assert not {p.problem for p in train} & {p.problem for p in val}


def test_shipped_template_renders_tools_calls_and_tool_turns(tokenizer) -> None:
    tools = list(tool_schemas(Calculator).values())
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 37, "b": 45}}}
    messages = [
        {"role": "user", "content": "37*45="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": "1665"},
        {"role": "assistant", "content": "\\boxed{1665}"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == TRACE
    # OpenAI-style arguments as a JSON string render the same call, and the default parser reads it back
    call["function"]["arguments"] = '{"a":37,"b":45}'
    assert tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) == TRACE
    reply = TRACE.split("<|assistant|>")[1].removesuffix("<|end|><|environment|>1665<|end|>")
    assert parse_hermes(reply) == [{"name": "multiply", "arguments": {"a": 37, "b": 45}}]
    # one character per token, specials included: the sequence the rollout feeds is 115 tokens
    assert len(tokenizer(TRACE, add_special_tokens=False)["input_ids"]) == 115


def test_shipped_template_continues_token_in_token_out(tokenizer) -> None:
    """The rollout's renderer accepts the template (it only appends) and feeds the tool turn as the model learnt it."""
    tools = list(tool_schemas(Calculator).values())
    renderer = ChatRenderer(tokenizer)
    prompt, _ = renderer.prompt([{"role": "user", "content": "37*45="}], tools, {})
    assert prompt == "<|system|>multiply(a,b)<|end|><|user|>37*45=<|end|><|assistant|>"
    reply = tokenizer('<tool_call>{"name":"multiply","arguments":{"a":37,"b":45}}</tool_call><|end|>')["input_ids"]
    text, ids = renderer.observation(reply, [{"role": "tool", "name": "multiply", "content": "1665"}], tools, {})
    assert text == "<|environment|>1665<|end|><|assistant|>"
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]

"""Observation continuations of a ChatML-style template (the layout of Qwen2.5 / Hermes tool templates, written
here for the test): the newline after the end-of-turn token the engine stopped on, tool results grouped into one
turn, the next generation prompt; and a template that rewrites earlier turns is refused in one line."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from relayrl.experience.chat_render import ChatRenderer, ChatTemplateError
from relayrl.experience.episodes import check_chat_template

TINY = Path(__file__).resolve().parents[3] / "relayrl" / "assets" / "tiny-arith"
CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | map(attribute='function.name') | join(',')) + "
    "'<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "write", "description": "Write.", "parameters": {}}}]


@pytest.fixture(scope="module")
def chatml_tokenizer():
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str((TINY / "tokenizer.json").read_text())
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>")
    tok.chat_template = CHATML
    return tok


def test_continuation_after_a_reply_that_stopped_on_its_end_of_turn_token(chatml_tokenizer) -> None:
    tok, renderer = chatml_tokenizer, ChatRenderer(chatml_tokenizer)
    text, ids = renderer.prompt([{"role": "user", "content": "hi"}], TOOLS, {})
    assert text == "<|im_start|>system\nTools: write<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    results = [{"role": "tool", "content": "one"}, {"role": "tool", "content": "two"}]
    reply = tok("x", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    text, ids = renderer.observation(reply, results, TOOLS, {})
    grouped = (
        "<|im_start|>user\n<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response><|im_end|>\n"
    )
    assert text == "\n" + grouped + "<|im_start|>assistant\n"  # the newline the engine did not generate, then the turn
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    unclosed = tok("x", add_special_tokens=False)["input_ids"]  # cut by the token budget: the whole end of turn
    assert renderer.observation(unclosed, results, TOOLS, {})[0] == "<|im_end|>\n" + grouped + "<|im_start|>assistant\n"
    # the whole conversation, rendered at once, is the prompt + reply + continuation pieces, character for character
    full = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}, *results],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert full == renderer.prompt([{"role": "user", "content": "hi"}], TOOLS, {})[0] + "x<|im_end|>" + text


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    rewriting = CHATML.replace("m['content'] + '<|im_end|>", "(m['content'] if loop.last else '...') + '<|im_end|>")
    other = copy.deepcopy(tok)  # the fixture's tokenizer is shared by the module
    other.chat_template = rewriting
    with pytest.raises(ChatTemplateError, match="renders the conversation differently once a 'tool' message follows"):
        check_chat_template(other, TOOLS, {})
    check_chat_template(tok, TOOLS, {})  # the append-only template passes


def test_prompts_render_and_tokenize_as_transformers_does(chatml_tokenizer) -> None:
    """`render_prompts` asks a fast tokenizer's backend directly; the ids are transformers' own, and a backend that
    carries truncation (which transformers would lift for the call) goes through transformers instead."""
    import gc

    from relayrl.experience.chat_render import render_prompts

    conversations = [[{"role": "user", "content": f"{a}+{a * 7}="}] for a in range(2500)]
    conversations[3] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <|im_end|>"}]
    expected_texts = chatml_tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
    expected_ids = chatml_tokenizer(expected_texts, add_special_tokens=False)["input_ids"]
    chunks = list(render_prompts(chatml_tokenizer, conversations, chunk=1024))
    assert [start for start, _, _ in chunks] == [0, 1024, 2048]
    assert [t for _, texts, _ in chunks for t in texts] == expected_texts
    assert [i for _, _, ids in chunks for i in ids] == expected_ids
    assert gc.isenabled()  # the collector is back on after the build

    truncating = copy.deepcopy(chatml_tokenizer)
    truncating.backend_tokenizer.enable_truncation(max_length=4)
    (_, texts, ids), *_ = render_prompts(truncating, conversations[:5])
    assert ids == expected_ids[:5] and max(map(len, ids)) > 4  # transformers' call: truncation off, as asked

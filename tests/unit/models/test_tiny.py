"""The character tokenizer, the tiny Qwen2 builder, and the shipped warm-started model."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.models.tiny import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    ROLES,
    SPECIAL_TOKENS,
    build_tiny_qwen2,
    count_parameters,
    save_tiny_model,
)
from tests.helpers import build_test_model

SHIPPED = Path(__file__).resolve().parents[3] / "relayrl" / "assets" / "tiny-arith"

ROUND_TRIP = [
    string.digits + string.ascii_letters + string.punctuation + " ",
    "a b\\c{d} \n  x",
    "it's  \n\n don't 12 + -3 = \\boxed{-9}",
    "   ",
    "\n",
    "",
    "37+45=",
]


def test_ids_are_fixed(char_tokenizer) -> None:
    assert char_tokenizer.pad_token_id == PAD_TOKEN_ID == 0
    assert char_tokenizer.eos_token_id == EOS_TOKEN_ID == 1
    assert char_tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert char_tokenizer.unk_token == "<unk>"
    assert char_tokenizer.bos_token is None
    assert char_tokenizer.padding_side == "right"
    assert len(char_tokenizer) == len(SPECIAL_TOKENS) + 95 + 1  # specials, printable ASCII, newline


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_one_id_per_character(char_tokenizer, text: str) -> None:
    ids = char_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert char_tokenizer.decode(ids) == text


def test_special_tokens_in_text_are_single_ids(char_tokenizer) -> None:
    for token in SPECIAL_TOKENS:
        text = f"a{token}b"
        ids = char_tokenizer.encode(text, add_special_tokens=False)
        assert ids == [
            char_tokenizer.convert_tokens_to_ids("a"),
            SPECIAL_TOKENS.index(token),
            char_tokenizer.convert_tokens_to_ids("b"),
        ]
        assert char_tokenizer.decode(ids) == text
    assert char_tokenizer.encode("xy", add_special_tokens=True) == char_tokenizer.encode("xy", add_special_tokens=False)


def test_chat_template_exact(char_tokenizer) -> None:
    messages = [{"role": role, "content": f"{role} says {{1}}"} for role in ROLES]
    text = char_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = "".join(f"<|{r}|>{r} says {{1}}<|end|>" for r in ROLES) + "<|assistant|>"
    assert text == expected
    plain = char_tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    assert plain == "<|user|>user says {1}<|end|>"
    ids = char_tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == SPECIAL_TOKENS.index("<|user|>")
    assert ids[-2:] == [EOS_TOKEN_ID, SPECIAL_TOKENS.index("<|assistant|>")]
    assert len(ids) == 1 + 4 + 1 + 1


def test_padding_right_with_pad_id(char_tokenizer) -> None:
    batch = char_tokenizer(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 2:].tolist() == [PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_build_is_deterministic_and_sized(char_tokenizer) -> None:
    a = build_tiny_qwen2(len(char_tokenizer), seed=3)
    b = build_tiny_qwen2(len(char_tokenizer), seed=3)
    c = build_tiny_qwen2(len(char_tokenizer), seed=4)
    sd_a, sd_b, sd_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert not torch.equal(sd_a["model.embed_tokens.weight"], sd_c["model.embed_tokens.weight"])
    assert 0.9e6 < count_parameters(a) < 1.2e6
    assert a.config.pad_token_id == PAD_TOKEN_ID and a.config.eos_token_id == EOS_TOKEN_ID
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()  # tied


def test_build_leaves_global_rng_alone(char_tokenizer) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_qwen2(len(char_tokenizer), hidden_size=32, num_layers=1, intermediate_size=32)
    assert torch.equal(torch.rand(3), expected)


def test_save_load_identical(tiny_model_dir: Path, char_tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    again = build_test_model(char_tokenizer)  # what conftest saved as tiny_model_dir
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "37+45="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == char_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for text in ROUND_TRIP + [prompt]:
        assert tokenizer.encode(text) == char_tokenizer.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = torch.tensor([char_tokenizer.encode(prompt)])  # [1, T]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)  # [1, T, V]
    assert model.generation_config.eos_token_id == EOS_TOKEN_ID
    assert model.generation_config.pad_token_id == PAD_TOKEN_ID


def test_save_writes_safetensors(tmp_path: Path, char_tokenizer) -> None:
    model = build_tiny_qwen2(len(char_tokenizer), hidden_size=32, num_layers=1, intermediate_size=32)
    save_tiny_model(tmp_path / "m", model, char_tokenizer)
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names


def test_shipped_model_loads_and_answers_in_format() -> None:
    assert SHIPPED.is_dir(), f"missing shipped model at {SHIPPED}; run scripts/make_tiny_model.py"
    assert (SHIPPED / "README.md").is_file()
    model = AutoModelForCausalLM.from_pretrained(SHIPPED).eval()
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    assert 0.9e6 < count_parameters(model) < 1.2e6
    assert tokenizer.eos_token_id == EOS_TOKEN_ID and tokenizer.pad_token_id == PAD_TOKEN_ID
    problems = ["37+45=", "12-98=", "50+50=", "81-17=", "66+23="]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in problems
    ]
    assert prompts[0] == "<|user|>37+45=<|end|><|assistant|>"
    for prompt in prompts:  # one at a time: right padding would put pads between prompt and answer
        ids = torch.tensor([tokenizer.encode(prompt)])  # [1, T]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False)  # [1, T + new]
        completion = out[0, ids.shape[1] :].tolist()
        assert completion[-1] == EOS_TOKEN_ID
        text = tokenizer.decode(completion, skip_special_tokens=True)
        assert text.startswith("\\boxed{") and text.endswith("}"), text

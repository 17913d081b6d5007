"""A character-level tokenizer and a tiny Qwen2, built offline.

The shipped model (``relayrl/assets/tiny-arith``) and the test fixtures both come from here, so the whole
library can be exercised end to end without the network or the Hugging Face hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|end|>"
UNK_TOKEN = "<unk>"
ROLES: tuple[str, ...] = ("user", "assistant", "system", "environment")
# Order fixes the ids: <pad> is 0 and <|end|> is 1, which build_tiny_qwen2 relies on for its defaults.
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    EOS_TOKEN,
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|environment|>",
    UNK_TOKEN,
)
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 1
# Printable ASCII (space..~) plus newline: everything the arithmetic task and chat transcripts need.
CHARACTERS: tuple[str, ...] = tuple(chr(c) for c in range(32, 127)) + ("\n",)
# Byte-level BPE spells bytes 0x21..0x7E as themselves but space and newline as these stand-ins.
_BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}

# Each message is `<|role|>content<|end|>`; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# The tool-use model's template (`relayrl/assets/tiny-calc`): the same messages, plus the tools as one short system
# line (`<|system|>multiply(a,b)<|end|>`: a character model pays a token per character, so no JSON schema), an
# assistant's `tool_calls` as compact `<tool_call>{"name":...,"arguments":{...}}</tool_call>` blocks (the Hermes
# format the default parser reads), and a `tool` message as an `<|environment|>` turn. It only appends: a message
# added never changes how the earlier ones render, so rollouts can feed observations token-in/token-out.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{{ f.name }}({{ f.parameters.properties | list | join(',') }}){% if not loop.last %} {% endif %}{% endfor %}"
    "<|end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|environment|>{{ message.content }}<|end|>"
    "{%- else %}<|{{ message.role }}|>{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{% set c = call.function if call.function is defined else call %}"
    '<tool_call>{"name":{{ c.name | tojson }},"arguments":'
    "{{ c.arguments if c.arguments is string else c.arguments | tojson(separators=(',', ':')) }}}</tool_call>"
    "{%- endfor %}<|end|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One id per character, so the tiny model never has to learn sub-word merges of digits.

    The backend is a byte-level BPE with an empty merge list, built through `Qwen2Tokenizer`: a directory whose
    config says `qwen2` is always reloaded by `AutoTokenizer` as `Qwen2Tokenizer`, which rebuilds a byte-level BPE
    pipeline from the saved vocabulary, so the in-memory tokenizer must already be exactly that pipeline for a save
    and reload to encode identically. With no merges every character stays its own token. Characters outside the
    vocabulary (tabs, non-ASCII) are dropped by the backend rather than mapped to `<unk>`.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(_BYTE_LEVEL.get(c, c) for c in CHARACTERS))}
    assert vocab[PAD_TOKEN] == PAD_TOKEN_ID and vocab[EOS_TOKEN] == EOS_TOKEN_ID
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)],
        padding_side="right",
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_qwen2(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    pad_token_id: int | None = PAD_TOKEN_ID,
    eos_token_id: int | None = EOS_TOKEN_ID,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2, identical for a given seed; the caller's global RNG state is left untouched."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    # Save and restore the global RNG so building a model does not perturb the caller's random stream.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = _generation_config(pad_token_id, eos_token_id)
    return model.eval()


def _generation_config(pad_token_id: int | None, eos_token_id: int | None) -> GenerationConfig:
    """So that `generate` stops at `<|end|>` and pads with `<pad>` without extra arguments."""
    return GenerationConfig(pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None)


def save_tiny_model(path: str | Path, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Write weights (safetensors), config, generation config and tokenizer (with chat template) to `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())

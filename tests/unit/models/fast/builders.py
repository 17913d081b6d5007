"""Small random llama-family models shared by the fast-path tests (each test file adds its own batches)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from relayrl.models.tiny import build_tiny_qwen2

VOCAB = 103  # the character tokenizer's size
ATOL = 1e-5
#: The geometry every small test model shares (4 query heads of 16 dims unless head_dim says otherwise).
SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=64,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
    "rope_theta": 10000.0,
}


def randomize(model: PreTrainedModel, seed: int = 1) -> PreTrainedModel:
    """Non-trivial norm weights and biases (HF initialises them to 1 and 0), so every parameter matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def qwen2_bench() -> PreTrainedModel:
    """The benchmarks' model shape (hidden 128, 2 layers), with the shipped model's defaults otherwise."""
    return randomize(build_tiny_qwen2(vocab_size=VOCAB, hidden_size=128, num_layers=2, seed=42))


def llama_gqa(num_layers: int = 2, *, pad_token_id: int | None = 0, rope: dict[str, Any] | None = LLAMA3_ROPE):
    """Grouped-query llama (4 query heads on 2 KV heads) with attention and MLP biases."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **{**SHAPE, "num_hidden_layers": num_layers},
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        pad_token_id=pad_token_id,
        rope_parameters=rope,
    )
    return randomize(LlamaForCausalLM(config))


def qwen3() -> PreTrainedModel:
    """Qwen3: q/k norms, a head size (24) that is not hidden / heads, tied embeddings."""
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)
    return randomize(Qwen3ForCausalLM(config))


def mistral() -> PreTrainedModel:
    """Mistral without a sliding window, one KV head for all query heads."""
    torch.manual_seed(0)
    config = MistralConfig(**SHAPE, num_key_value_heads=1, sliding_window=None)
    return randomize(MistralForCausalLM(config))

"""Which models, dtypes and devices the fast path reproduces exactly, and how it reads a supported model's weights.

One check serves both users: `FastDecoder` (generation, which also applies the LM head) and the full-sequence
passes of `forward` (log-probs, reference, training, a critic's bare backbone). A model the check refuses goes
through HF's own forward, so the fast path never has to be approximately right. The compiled CPU kernels
(`kernels`) cover a narrower set again: float32 CPU tensors and even head sizes up to `NATIVE_MAX_HEAD_DIM`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

FAST_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# RoPE variants whose cos/sin depend on the position only (not on the running sequence length).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
#: Largest (even) head size the compiled kernels take (csrc/cpu_kernels.cpp kMaxHeadDim).
NATIVE_MAX_HEAD_DIM = 512
#: HF's own forward hook on the input embeddings (set by activation checkpointing): the fast path reproduces it.
INPUT_GRADS_HOOK = "make_inputs_require_grads"


def backbone_of(model: nn.Module) -> Any:
    """The transformer stack: `model.model` for a causal LM, the module itself for a bare backbone."""
    return model if hasattr(model, "layers") else getattr(model, "model", None)


def fast_path_unsupported(model: nn.Module, *, lm_head: bool = False) -> str | None:
    """None when the fast path reproduces `model` exactly right now, else the reason it cannot.

    `lm_head`: the caller also runs the model's LM head through the fast path (generation); the full-sequence passes
    apply the head themselves, so a bare backbone (a critic's) or an adapted head does not stop them.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(FAST_MODEL_TYPES)}"
    base = backbone_of(model)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "unexpected module layout (needs embed_tokens/layers/norm/rotary_emb)"
    if lm_head and not hasattr(model, "lm_head"):
        return "no lm_head (a bare backbone cannot generate)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} (only silu)"
    rope_type = getattr(base.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} depends on sequence length"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) is not None and (
        model_type == "mistral" or "sliding_attention" in layer_types
    ):
        return "sliding-window attention"
    embed = base.embed_tokens
    if type(embed) is not nn.Embedding or embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        return "embed_tokens is not a plain nn.Embedding"
    linears = [model.lm_head] if lm_head else []
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if any(type(m) is not nn.Linear for m in linears):
        return "projections are not plain nn.Linear (adapters or quantisation)"
    if any(type(p.data) is not torch.Tensor for p in (model if lm_head else base).parameters()):
        return "parameters are not plain tensors (sharded or quantised)"
    if base.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0:
        return "attention dropout in training mode"
    if has_hooks(base):
        return "module hooks are registered (they would not fire)"
    return None


def has_hooks(base: nn.Module) -> bool:
    """Whether any hook would run in HF's forward, other than HF's input-grads hook on the embeddings."""
    from torch.nn.modules import module as module_lib

    globals_ = (
        module_lib._global_forward_hooks,
        module_lib._global_forward_pre_hooks,
        module_lib._global_backward_hooks,
        module_lib._global_backward_pre_hooks,
    )
    if any(globals_):
        return True
    for m in base.modules():
        forward_hooks = list(m._forward_hooks.values())
        if m is getattr(base, "embed_tokens", None):
            forward_hooks = [h for h in forward_hooks if getattr(h, "__name__", None) != INPUT_GRADS_HOOK]
        if forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
    return False


def input_grads_hooked(embed: nn.Module) -> bool:
    """Whether HF's input-grads hook sits on `embed` (the fast path then marks the embedding output as needing grad)."""
    return any(getattr(h, "__name__", None) == INPUT_GRADS_HOOK for h in embed._forward_hooks.values())


def native_head_dim(head_dim: int) -> bool:
    """Whether the compiled kernels take this head size (even, at most NATIVE_MAX_HEAD_DIM)."""
    return head_dim <= NATIVE_MAX_HEAD_DIM and head_dim % 2 == 0


def native_tensors(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels take these tensors: float32, on the CPU."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return True


class Layer(NamedTuple):
    """One decoder layer's parameter tensors by role, read in place (no copies: updates are seen at once)."""

    in_norm: torch.Tensor
    in_eps: float
    q: tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias) of each projection
    k: tuple[torch.Tensor, torch.Tensor | None]
    v: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    q_norm: torch.Tensor | None  # qwen3: RMSNorm over each head's dims before RoPE
    k_norm: Any  # set exactly when q_norm is
    qk_eps: float
    post_norm: torch.Tensor
    post_eps: float
    gate: tuple[torch.Tensor, torch.Tensor | None]
    up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]


def weight_and_bias(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of an nn.Linear, in the order F.linear takes them."""
    return linear.weight, linear.bias


def read_layer(layer: Any) -> Layer:
    """The tensors of one HF llama-family decoder layer (attributes read by name, as the HF forward does)."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return Layer(
        in_norm=layer.input_layernorm.weight,
        in_eps=layer.input_layernorm.variance_epsilon,
        q=weight_and_bias(attn.q_proj),
        k=weight_and_bias(attn.k_proj),
        v=weight_and_bias(attn.v_proj),
        o=weight_and_bias(attn.o_proj),
        q_norm=None if q_norm is None else q_norm.weight,
        k_norm=None if k_norm is None else k_norm.weight,
        qk_eps=1e-6 if q_norm is None else q_norm.variance_epsilon,
        post_norm=layer.post_attention_layernorm.weight,
        post_eps=layer.post_attention_layernorm.variance_epsilon,
        gate=weight_and_bias(mlp.gate_proj),
        up=weight_and_bias(mlp.up_proj),
        down=weight_and_bias(mlp.down_proj),
    )

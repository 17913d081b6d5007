"""Which models, dtypes and devices the fast path reproduces exactly, and how it reads a supported model's weights.

One check serves both users: `FastDecoder` (generation, which also applies the LM head) and the full-sequence
passes of `forward` (log-probs, reference, training, a critic's bare backbone). A model the check refuses goes
through HF's own forward, so the fast path never has to be approximately right. The compiled CPU kernels
(`kernels`) cover a narrower set again: float32 CPU tensors and even head sizes up to `NATIVE_MAX_HEAD_DIM`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
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
    apply the head themselves, so a bare backbone (a critic's) or an adapted head does not stop them. The
    full-sequence passes also take `peft` LoRA projections (`lora_projection`); generation needs plain ones.
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
    for m in linears:
        if type(m) is not nn.Linear and (lm_head or lora_projection(m) is None):
            kinds = "plain nn.Linear" if lm_head else "plain nn.Linear or LoRA without active dropout"
            return f"projections are not {kinds} (adapters or quantisation)"
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
    q: tuple[Any, ...]  # (weight, bias) of each projection; a LoRA one adds (A, B, scaling): see `projection`
    k: tuple[Any, ...]
    v: tuple[Any, ...]
    o: tuple[Any, ...]
    q_norm: torch.Tensor | None  # qwen3: RMSNorm over each head's dims before RoPE
    k_norm: Any  # set exactly when q_norm is
    qk_eps: float
    post_norm: torch.Tensor
    post_eps: float
    gate: tuple[Any, ...]
    up: tuple[Any, ...]
    down: tuple[Any, ...]


def lora_projection(module: Any) -> tuple[Any, ...] | None:
    """A `peft` LoRA linear layer the fast path reproduces: () when its adapters are off (the base layer alone),
    (lora_A weight, lora_B weight, scaling) for its one active adapter; None for anything else (not LoRA, merged,
    several adapters, DoRA-style variants, LoRA biases, transposed weights, dropout active in training mode)."""
    base = getattr(module, "base_layer", None)
    if type(base) is not nn.Linear or not hasattr(module, "lora_A") or getattr(module, "merged", True):
        return None
    if getattr(module, "fan_in_fan_out", False):
        return None
    if module.disable_adapters:
        return ()
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1 or active[0] in getattr(module, "lora_variant", {}):
        return None
    name = active[0]
    a, b, dropout = module.lora_A[name], module.lora_B[name], module.lora_dropout[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
        return None
    if type(dropout) is not nn.Identity and (dropout.training and float(getattr(dropout, "p", 1.0)) > 0):
        return None
    return a.weight, b.weight, float(module.scaling[name])


def weight_and_bias(linear: Any) -> tuple[Any, ...]:
    """(weight, bias) of an nn.Linear, in the order F.linear takes them; a LoRA layer adds (A, B, scaling) of its
    active adapter (see `lora_projection`)."""
    if type(linear) is nn.Linear:
        return linear.weight, linear.bias
    lora = lora_projection(linear)
    if lora is None:
        raise ValueError(f"{type(linear).__name__} is not a projection the fast path reproduces")
    return (linear.base_layer.weight, linear.base_layer.bias, *lora)


def projection(x: torch.Tensor, proj: tuple[Any, ...]) -> torch.Tensor:
    """x @ W^T + b of a `weight_and_bias` entry, plus (x @ A^T) @ B^T * scaling for a LoRA one (the op order of
    peft's forward: base output first, the adapter's added to it)."""
    if len(proj) == 2:
        return F.linear(x, proj[0], proj[1])
    weight, bias, lora_a, lora_b, scaling = proj
    return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_a), lora_b) * scaling


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

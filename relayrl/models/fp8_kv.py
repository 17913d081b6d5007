"""FP8 (float8 e4m3) KV cache: the scale names calibration produces and generation consumes, and the arithmetic.

Calibration (`PolicyWorker.calibrate_qkv_fp8_scales`) watches the tensors every attention call receives, i.e. q, k
and v after the q/k norms (qwen3) and RoPE, exactly what the KV cache stores; `observe_attention_inputs` puts an
observer in front of the model's own attention function for the duration. The result is
`{"format": "fp8", "percentile": p, "margin": m, "layers": {name: scale}}` with the reference's (vLLM's) names:

    model.layers.N.self_attn.attn.q_scale   (only with include_q)
    model.layers.N.self_attn.k_scale
    model.layers.N.self_attn.v_scale

and scale = amax_p * margin / FP8_MAX, FP8_MAX = 448 (the e4m3 maximum; env FP8_MAX_Q / FP8_MAX_K / FP8_MAX_V
override it per tensor, as in the reference). The `layers` dict travels with the refit to generation, where
`policy.generation.kv_cache_dtype=fp8` stores k / scale and v / scale as torch.float8_e4m3fn (saturated at +-448) and
multiplies by the scale again on every read. The q scale is accepted and ignored: attention itself runs in the
model's dtype here (vLLM uses it for FP8 attention arithmetic).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite float8 e4m3fn value.
FP8_E4M3_MAX = 448.0
_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.q|k|v)_scale$")

#: What an attention call shows the calibration running in this thread / task: (attention module, q, k, v).
Observer = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], None]
_OBSERVER: contextvars.ContextVar[Observer | None] = contextvars.ContextVar("relayrl_attention_observer", default=None)
_OBSERVING_PREFIX = "relayrl_observe_"


def fp8_max(which: str) -> float:
    """The FP8 maximum a q/k/v scale maps to: env FP8_MAX_Q / FP8_MAX_K / FP8_MAX_V, else 448."""
    value = float(os.environ.get(f"FP8_MAX_{which.upper()}", FP8_E4M3_MAX))
    if not value > 0:
        raise ValueError(f"FP8_MAX_{which.upper()} must be positive, got {value}")
    return value


def scale_name(layer: int, which: str) -> str:
    """The reference's (vLLM's) parameter name of one layer's q, k or v scale."""
    if which == "q":
        return f"model.layers.{layer}.self_attn.attn.q_scale"
    if which in ("k", "v"):
        return f"model.layers.{layer}.self_attn.{which}_scale"
    raise ValueError(f"which must be 'q', 'k' or 'v', got {which!r}")


def num_layers(model: nn.Module) -> int:
    """Decoder layers of an HF model (its text config's num_hidden_layers)."""
    config: Any = model.config
    return int(config.get_text_config(decoder=True).num_hidden_layers)


def kv_cache_scales(scales: Mapping[str, float], num_layers: int) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer from a calibration's `layers` dict; every layer needs both, all positive."""
    bad = [n for n in scales if not _NAME.match(n)]
    if bad:
        raise ValueError(f"kv_scales: unexpected name {bad[0]!r} (expected e.g. {scale_name(0, 'k')!r})")
    out = []
    for layer in range(num_layers):
        pair = []
        for which in ("k", "v"):
            name = scale_name(layer, which)
            if name not in scales:
                raise ValueError(f"kv_scales has no {name!r} ({num_layers} layers need a k and a v scale each)")
            value = float(scales[name])
            if not (value > 0 and value < float("inf")):
                raise ValueError(f"kv_scales[{name!r}] must be positive and finite, got {value}")
            pair.append(value)
        out.append((pair[0], pair[1]))
    extra = [n for n in scales if int(n.split(".")[2]) >= num_layers]
    if extra:
        raise ValueError(f"kv_scales names layer {extra[0]!r} but the model has {num_layers} layers")
    return out


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, saturated at +-448, as float8 e4m3fn (same shape)."""
    return (x / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """float8 values back to `dtype`, times the scale."""
    return x.to(dtype).mul_(scale)


def masked_amax(t: torch.Tensor, real: torch.Tensor) -> float:
    """max |t| over the real tokens: t [b, heads, S, D] as attention receives it, real [b, S] bool."""
    b, _, s, _ = t.shape
    if real.shape != (b, s):
        raise ValueError(f"attention input of shape {tuple(t.shape)} does not match a token mask {tuple(real.shape)}")
    per_token = t.detach().abs().amax(dim=(1, 3)).float()  # [b, S]
    return float(per_token.masked_fill(~real, 0.0).max()) if per_token.numel() else 0.0


def _observing(inner_name: str) -> Callable[..., Any]:
    """An attention function that shows (q, k, v) to this context's observer, then runs `inner_name`'s."""

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        observer = _OBSERVER.get()
        if observer is not None:
            observer(module, query, key, value)
        if inner_name == "eager":  # the modeling file's own function, as HF's forward picks it
            inner = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if inner is None:
                raise ValueError(f"{type(module).__name__}: its module has no eager_attention_forward")
        else:
            inner = ALL_ATTENTION_FUNCTIONS[inner_name]
        return inner(module, query, key, value, attention_mask, **kwargs)

    return attention


@contextlib.contextmanager
def observe_attention_inputs(model: nn.Module, observer: Observer) -> Iterator[None]:
    """While open, every attention call of `model`'s HF forward first passes its (q, k, v) to `observer`
    (module, q [b, Hq, S, D], k [b, Hkv, S, D], v [b, Hkv, S, D]) in this thread / task.

    The model's attention implementation is swapped for a registered wrapper of itself (same attention mask, same
    kernel) and restored on exit. Only HF's forward calls it: relayrl's fast path does not run here.
    """
    config: Any = model.config
    inner = config._attn_implementation or "eager"
    if inner.startswith(_OBSERVING_PREFIX):
        raise RuntimeError("observe_attention_inputs is already open on this model")
    name = _OBSERVING_PREFIX + inner
    AttentionInterface.register(name, _observing(inner))
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:  # the same mask the model builds for its own implementation
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    token = _OBSERVER.set(observer)
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = inner
        _OBSERVER.reset(token)


class Fp8CacheLayer(DynamicLayer):
    """One layer of `fp8_cache`: K and V kept as float8 e4m3fn (k / k_scale, v / v_scale), returned dequantized."""

    def __init__(self, k_scale: float, v_scale: float) -> None:
        super().__init__()
        self.k_scale, self.v_scale = k_scale, v_scale

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = torch.empty(0, dtype=FP8_DTYPE, device=self.device)
        self.values = torch.empty(0, dtype=FP8_DTYPE, device=self.device)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        new_k, new_v = quantize(key_states, self.k_scale), quantize(value_states, self.v_scale)
        self.keys = new_k if self.keys.numel() == 0 else torch.cat([self.keys, new_k], dim=-2)
        self.values = new_v if self.values.numel() == 0 else torch.cat([self.values, new_v], dim=-2)
        return (
            dequantize(self.keys, self.k_scale, key_states.dtype),
            dequantize(self.values, self.v_scale, value_states.dtype),
        )


def fp8_cache(model: nn.Module, scales: list[tuple[float, float]]) -> DynamicCache:
    """A transformers DynamicCache of `Fp8CacheLayer`s (one per layer, its (k_scale, v_scale) from `scales`).
    Full-attention layers only: a model whose cache would hold sliding-window layers is refused."""
    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]
    if len(cache.layers) != len(scales):
        raise ValueError(f"kv_scales cover {len(scales)} layers but the model's cache has {len(cache.layers)}")
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(f"kv_cache_dtype=fp8 supports full-attention layers only; layer {i} is {layer!r}")
    cache.layers = [Fp8CacheLayer(k, v) for k, v in scales]
    return cache

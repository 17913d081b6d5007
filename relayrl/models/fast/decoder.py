"""KV-cache decoders behind HfGeneration: a lean Llama-family forward pass, and a generic HF-forward fallback.

Both take left-padded prompts and expose the same three calls: `start` (prefill, returns the next-token logits of
every row), `step` (feed one token per live row, write its K/V at one cache column, return logits) and `select`
(keep / reorder / repeat rows of the batch and their caches).

`FastDecoder` reads the weight tensors of a llama / mistral / qwen2 / qwen3 module in place (so a colocated engine
always samples from the live policy weights) and computes exactly what the HF modules compute, minus the per-call
Python machinery: no module hooks, no mask builders, no cache objects, a grouped-query view instead of repeating K/V
during decode. Models it cannot reproduce exactly are reported by `support.fast_path_unsupported(model,
lm_head=True)` and go through `HfDecoder`. On CPU, a float32 model without q/k norms can run each decode step as one
call of relayrl's compiled step (`kernels`, `native=True`): the same computation with the work between the matrix
products in C++ loops instead of ~400 dispatched ops.

With `kv_scales` (one (k_scale, v_scale) per layer; `policy.generation.kv_cache_dtype=fp8`) both decoders keep the
cache as float8 e4m3 (`fp8_kv.quantize`: k / k_scale, saturated) and attend to its dequantized values, the prompt's
included (prefill attends to what the cache holds, so a token's log-prob does not depend on whether it was in the
prompt). The compiled CPU step reads float32 caches only: with FP8 the fast decoder runs its PyTorch ops.

With `compute` (`policy.precision` bfloat16 / float16: `ComputeWeights`, the engine's low-precision copy of the
projections) `FastDecoder` decodes the way autocast runs the training forward: projections, attention and the KV
cache in the compute dtype, the residual stream, RMSNorm, RoPE and the embedding lookup in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from relayrl.models import fp8_kv
from relayrl.models.fast.compute_weights import ComputeWeights
from relayrl.models.fast.kernels import load_cpu_kernels, rms_norm, rope
from relayrl.models.fast.support import (
    Layer,
    backbone_of,
    native_head_dim,
    native_tensors,
    read_layer,
    weight_and_bias,
)


def _with_copies(layer: Layer, compute: ComputeWeights) -> Layer:
    """`layer` with each projection's (weight, bias) replaced by their compute-dtype copies (norms stay float32)."""

    def cast(proj: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(compute(t) for t in proj)

    return layer._replace(
        q=cast(layer.q),
        k=cast(layer.k),
        v=cast(layer.v),
        o=cast(layer.o),
        gate=cast(layer.gate),
        up=cast(layer.up),
        down=cast(layer.down),
    )


#: Prompt tokens per prefill chunk (rows are chunked so this many positions go through the model at once).
PREFILL_TOKENS_PER_CHUNK = 8192


class FastDecoder:
    """Llama-family decode with a preallocated KV cache [b, H_kv, T, D] per layer and left-padded rows.

    `native`: run each decode step as one call of relayrl's compiled CPU step (`kernels`) when the model is a
    float32 CPU model (with or without bfloat16 `compute` copies) without q/k norms and the library loads; otherwise
    (or with native=False) PyTorch ops.
    `kv_scales`: (k_scale, v_scale) per layer: an FP8 cache (PyTorch ops only); None: the model's dtype.
    `compute`: the projections' low-precision copies (refreshed by the caller); None: the model's own tensors."""

    def __init__(
        self,
        model: Any,
        *,
        native: bool = False,
        kv_scales: list[tuple[float, float]] | None = None,
        compute: ComputeWeights | None = None,
    ) -> None:
        base = backbone_of(model)  # HF modules are dynamic: attributes are read by name, as the HF forward does
        attn0 = base.layers[0].self_attn
        self.embed = base.embed_tokens.weight  # [V, H]
        self.final_norm, self.final_eps = base.norm.weight, base.norm.variance_epsilon
        self.head = weight_and_bias(model.lm_head)
        self.rotary = base.rotary_emb
        self.head_dim = attn0.head_dim
        self.n_heads = attn0.q_proj.out_features // self.head_dim
        self.n_kv = attn0.k_proj.out_features // self.head_dim
        self.group = self.n_heads // self.n_kv
        self.scaling = float(attn0.scaling)
        self.layers = [read_layer(layer) for layer in base.layers]
        self.low: torch.dtype | None = None  # compute dtype of projections / attention / cache; None: the model's
        if compute is not None:
            self.low = compute.dtype
            self.head = tuple(compute(t) for t in self.head)
            self.layers = [_with_copies(layer, compute) for layer in self.layers]
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.key_bias: torch.Tensor | None = None  # [b, 1, 1, T] additive: -inf at left-pad columns
        if kv_scales is not None and len(kv_scales) != len(self.layers):
            raise ValueError(f"kv_scales cover {len(kv_scales)} layers, the model has {len(self.layers)}")
        self.kv_scales = kv_scales
        self.native = kv_scales is None and native and self._native_supported() and load_cpu_kernels()
        if self.native:
            order = ("in_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down")
            self._native_weights: list[torch.Tensor | None] = []
            for layer in self.layers:
                for name in order:
                    entry = getattr(layer, name)
                    self._native_weights.extend(entry if isinstance(entry, tuple) else (entry,))
            self._native_eps = [float(e) for layer in self.layers for e in (layer.in_eps, layer.post_eps)]

    def _native_supported(self) -> bool:
        """The compiled step covers CPU models without q/k norms whose tensors are all contiguous: float32, or
        bfloat16 projections (`compute`) over float32 embeddings and norms."""
        if not native_head_dim(self.head_dim) or any(layer.q_norm is not None for layer in self.layers):
            return False
        if self.low not in (None, torch.bfloat16):
            return False
        tensors = [self.embed, self.final_norm]
        projections = [t for t in self.head if t is not None]
        for layer in self.layers:
            for entry in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down):
                projections.extend(t for t in entry if t is not None)
            tensors += [layer.in_norm, layer.post_norm]
        if self.low is None:
            tensors, projections = tensors + projections, []
        low_ok = all(t.dtype == self.low and t.device.type == "cpu" for t in projections)
        return low_ok and native_tensors(*tensors) and all(t.is_contiguous() for t in tensors + projections)

    def start(self, ids: torch.Tensor, key_valid: torch.Tensor, positions: torch.Tensor, capacity: int) -> torch.Tensor:
        """Prefill left-padded prompts ids [B, P]; caches hold `capacity` columns. Returns last-token logits [B, V]."""
        batch, cols = ids.shape
        dtype, device = self.embed.dtype, self.embed.device
        cos, sin = self.rotary(self.embed[:1], torch.arange(capacity, device=device).unsqueeze(0))  # [1, T, D]
        half = self.head_dim // 2
        self.cos = cos[0]  # [T, D]
        self.signed_sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [T, D]
        shape = (batch, self.n_kv, capacity, self.head_dim)
        dtype = self.low or dtype  # the cache and additive masks live in the compute dtype
        cache_dtype = dtype if self.kv_scales is None else fp8_kv.FP8_DTYPE
        self.k_cache = [torch.empty(shape, dtype=cache_dtype, device=device) for _ in self.layers]
        self.v_cache = [torch.empty(shape, dtype=cache_dtype, device=device) for _ in self.layers]
        self.key_bias = None
        if not bool(key_valid.all()):
            self.key_bias = torch.zeros((batch, 1, 1, capacity), dtype=dtype, device=device)
            self.key_bias[:, 0, 0, :cols].masked_fill_(~key_valid, float("-inf"))
        # Rows in chunks, so activations ([rows, P, intermediate]) and masks stay bounded for long prompts.
        rows = max(1, PREFILL_TOKENS_PER_CHUNK // cols)
        logits = [
            self._prefill(ids[a : a + rows], key_valid[a : a + rows], positions[a : a + rows], a)
            for a in range(0, batch, rows)
        ]
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def _prefill(self, ids: torch.Tensor, key_valid: torch.Tensor, positions: torch.Tensor, row0: int) -> torch.Tensor:
        """Prefill cache rows [row0, row0 + len(ids)); returns their last-token logits [rows, V]."""
        batch, cols = ids.shape
        bias = None
        if self.key_bias is not None:
            allowed = torch.ones((cols, cols), dtype=torch.bool, device=ids.device).tril() & key_valid.unsqueeze(1)
            allowed |= torch.eye(cols, dtype=torch.bool, device=ids.device)  # pad queries see themselves: no NaN rows
            bias = torch.zeros((batch, 1, cols, cols), dtype=self.low or self.embed.dtype, device=ids.device)
            bias.masked_fill_(~allowed.unsqueeze(1), float("-inf"))  # [rows, 1, P, P]
        cos = self.cos[positions].unsqueeze(1)  # [rows, 1, P, D]
        sin = self.signed_sin[positions].unsqueeze(1)
        h = F.embedding(ids, self.embed)  # [rows, P, H]
        low = self.low
        attn_dtype = low or h.dtype
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, self.k_cache, self.v_cache)):
            x = rms_norm(h, layer.in_norm, layer.in_eps)
            if low is not None:
                x = x.to(low)
            q = F.linear(x, *layer.q).view(batch, cols, self.n_heads, self.head_dim)
            k = F.linear(x, *layer.k).view(batch, cols, self.n_kv, self.head_dim)
            v = F.linear(x, *layer.v).view(batch, cols, self.n_kv, self.head_dim).transpose(1, 2)  # [rows, Hkv, P, D]
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, layer.qk_eps), rms_norm(k, layer.k_norm, layer.qk_eps)
            q = rope(q.transpose(1, 2), cos, sin)  # [rows, Hq, P, D]
            k = rope(k.transpose(1, 2), cos, sin)  # [rows, Hkv, P, D]
            if self.kv_scales is None:
                k_cache[row0 : row0 + batch, :, :cols] = k
                v_cache[row0 : row0 + batch, :, :cols] = v
            else:  # attend to what the cache holds
                k_scale, v_scale = self.kv_scales[i]
                k8, v8 = fp8_kv.quantize(k, k_scale), fp8_kv.quantize(v, v_scale)
                k_cache[row0 : row0 + batch, :, :cols] = k8
                v_cache[row0 : row0 + batch, :, :cols] = v8
                k, v = fp8_kv.dequantize(k8, k_scale, attn_dtype), fp8_kv.dequantize(v8, v_scale, attn_dtype)
            if low is not None:  # attention in the compute dtype (autocast's SDPA), keys as the cache rounds them
                q, k, v = q.to(low), k.to(low), v.to(low)
            if self.group > 1:
                k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None, scale=self.scaling)
            h = h + F.linear(a.transpose(1, 2).reshape(batch, cols, -1), *layer.o)
            x = rms_norm(h, layer.post_norm, layer.post_eps)
            if low is not None:
                x = x.to(low)
            h = h + F.linear(F.silu(F.linear(x, *layer.gate)) * F.linear(x, *layer.up), *layer.down)
        x = rms_norm(h[:, -1], self.final_norm, self.final_eps)
        return F.linear(x if low is None else x.to(low), *self.head)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, col: int) -> torch.Tensor:
        """Feed tokens [b] at position ids [b], cached at column `col`; returns next-token logits [b, V]."""
        if self.native:
            return self._native_step(tokens, positions, col)
        b = tokens.shape[0]
        end = col + 1
        # index_select / narrow / copy_ rather than tensor indexing and slice assignment: same values, less
        # per-call dispatch, which dominates at decode sizes.
        cos = self.cos.index_select(0, positions).view(b, 1, 1, self.head_dim)
        sin = self.signed_sin.index_select(0, positions).view(b, 1, 1, self.head_dim)
        bias = None if self.key_bias is None else self.key_bias.narrow(3, 0, end)  # [b, 1, 1, end]
        # On CPU the three-op attention wins in float32; in bfloat16 its batched matmuls copy the cached keys and
        # values every step, while SDPA reads them in place.
        on_cpu = tokens.device.type == "cpu" and self.low is None
        attend = self._decode_attention_on_cpu if on_cpu else self._decode_attention
        if on_cpu and bias is not None:
            bias = bias.expand(b, self.n_kv, 1, end).reshape(b * self.n_kv, 1, end)  # per (row, KV head), once
        h = F.embedding(tokens, self.embed)  # [b, H]
        low = self.low
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, self.k_cache, self.v_cache)):
            x = rms_norm(h, layer.in_norm, layer.in_eps)
            if low is not None:
                x = x.to(low)
            # Grouped-query view: the G query heads sharing a KV head become G query rows of that head.
            q = F.linear(x, *layer.q).view(b, self.n_kv, self.group, self.head_dim)
            k = F.linear(x, *layer.k).view(b, self.n_kv, 1, self.head_dim)
            v = F.linear(x, *layer.v).view(b, self.n_kv, 1, self.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, layer.qk_eps), rms_norm(k, layer.k_norm, layer.qk_eps)
            if self.kv_scales is None:
                k_cache.narrow(2, col, 1).copy_(rope(k, cos, sin))
                v_cache.narrow(2, col, 1).copy_(v)
                keys, values = k_cache.narrow(2, 0, end), v_cache.narrow(2, 0, end)
            else:
                k_scale, v_scale = self.kv_scales[i]
                k_cache.narrow(2, col, 1).copy_(fp8_kv.quantize(rope(k, cos, sin), k_scale))
                v_cache.narrow(2, col, 1).copy_(fp8_kv.quantize(v, v_scale))
                keys = fp8_kv.dequantize(k_cache.narrow(2, 0, end), k_scale, low or h.dtype)
                values = fp8_kv.dequantize(v_cache.narrow(2, 0, end), v_scale, low or h.dtype)
            q = rope(q, cos, sin)
            a = attend(q if low is None else q.to(low), keys, values, bias)  # [b, Hkv, G, D]
            h = h + F.linear(a.reshape(b, -1), *layer.o)
            x = rms_norm(h, layer.post_norm, layer.post_eps)
            if low is not None:
                x = x.to(low)
            h = h + F.linear(F.silu(F.linear(x, *layer.gate)) * F.linear(x, *layer.up), *layer.down)
        x = rms_norm(h, self.final_norm, self.final_eps)
        return F.linear(x if low is None else x.to(low), *self.head)

    def _native_step(self, tokens: torch.Tensor, positions: torch.Tensor, col: int) -> torch.Tensor:
        """`step` as one call of the compiled CPU step (same values to float32 rounding)."""
        bias = None if self.key_bias is None else self.key_bias.view(self.key_bias.shape[0], -1)  # [b, T]
        return torch.ops.relayrl_cpu.decode_step(
            tokens,
            self.embed,
            self._native_weights,
            self._native_eps,
            self.k_cache,
            self.v_cache,
            self.cos,
            self.signed_sin,
            positions.contiguous(),
            bias,
            col,
            self.n_heads,
            self.n_kv,
            self.head_dim,
            self.scaling,
            self.final_norm,
            float(self.final_eps),
            *self.head,
        )

    def _decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """q [b, Hkv, G, D] against the cached k/v [b, Hkv, T, D] (bias [b, 1, 1, T] or None) -> [b, Hkv, G, D]."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scaling)

    def _decode_attention_on_cpu(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """As `_decode_attention` (bias [b * Hkv, 1, T] here), as three batched matmul-level ops.

        For one query per row the CPU SDPA kernel spends more on its blocking set-up than on the arithmetic; scores
        by baddbmm, softmax, then bmm take less per call at the bench's shape (docs/design.md). Values agree with
        SDPA to float32 rounding (~1e-7), not bitwise."""
        b, hkv, g, d = q.shape
        t = k.shape[2]
        q3, k3, v3 = q.reshape(b * hkv, g, d), k.reshape(b * hkv, t, d), v.reshape(b * hkv, t, d)
        if bias is None:
            scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(self.scaling)  # [b * Hkv, G, T]
        else:
            scores = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=self.scaling)  # [b * Hkv, G, T]
        return torch.bmm(scores.softmax(dim=-1), v3).view(b, hkv, g, d)

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` (in that order; repeats allowed) of every cache."""
        self.k_cache = [c.index_select(0, index) for c in self.k_cache]
        self.v_cache = [c.index_select(0, index) for c in self.v_cache]
        if self.key_bias is not None:
            self.key_bias = self.key_bias.index_select(0, index)


class HfDecoder:
    """Any HF causal LM through its own forward and a DynamicCache (correct everywhere, slower per step); with
    `kv_scales`, a DynamicCache of float8 layers (`fp8_kv.fp8_cache`, full-attention models only)."""

    def __init__(self, model: Any, *, kv_scales: list[tuple[float, float]] | None = None) -> None:
        self.model = model
        self.kv_scales = kv_scales
        self.cache: Any = None
        self.mask = torch.empty(0, dtype=torch.long)  # [b, T] 1 = real token, set by start()

    def start(self, ids: torch.Tensor, key_valid: torch.Tensor, positions: torch.Tensor, capacity: int) -> torch.Tensor:
        """Prefill left-padded prompts ids [B, P] through the model's forward; returns last-token logits [B, V]."""
        from transformers import DynamicCache

        if self.kv_scales is None:
            self.cache = DynamicCache(config=self.model.config)
        else:
            self.cache = fp8_kv.fp8_cache(self.model, self.kv_scales)
        cols = ids.shape[1]
        self.mask = torch.ones((ids.shape[0], capacity), dtype=torch.long, device=ids.device)
        self.mask[:, :cols] = key_valid.long()
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask[:, :cols],
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, col: int) -> torch.Tensor:
        """Feed tokens [b] at position ids [b] (cache column `col`); returns next-token logits [b, V]."""
        out = self.model(
            input_ids=tokens.unsqueeze(1),
            attention_mask=self.mask[:, : col + 1],
            position_ids=positions.unsqueeze(1),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` (in that order; repeats allowed) of the cache and the attention mask."""
        self.cache.reorder_cache(index)
        self.mask = self.mask.index_select(0, index)

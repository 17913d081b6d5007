"""Full-sequence backbone forward for llama-family policies that skips the padding of right-padded batches.

The log-prob, reference and training passes only need the final hidden states of every *real* token. At the
bench shape (32 rows x ~75 tokens, hidden 128) these passes are bound by matmul FLOPs, not by HF's per-call Python
overhead (a small share of the pass; docs/design.md), so the saving has to come from doing less arithmetic.
`backbone_hidden_states` runs the model's own parameter tensors (autograd flows into the HF module's parameters;
nothing is copied or cached) through the same ops and dtypes as the HF modules, with two changes that leave every
real token's result unchanged:

* Packing: embeddings, norms, projections, RoPE and the MLP run on the N real tokens only ([N, H] instead of
  [B, S, H]); only attention sees the padded [B, heads, S, D] layout.
* Masking: rows are right-padded, so a plain causal mask already keeps every real query off the padding keys;
  attention runs with `is_causal=True` and no mask tensor. Pad queries attend to padding, but their outputs are
  dropped when repacking.

Positions at or past a row's length come back as zeros (HF would return values nobody reads). A row of length 0 is
treated as length 1, as the HF path's attention mask does. Models the fast path cannot reproduce exactly, module
hooks (e.g. FP8 calibration), and attention dropout while training go through HF's forward instead.

`packed=True` (sequence packing: a micro-batch that is a bin of sequences of very different lengths) runs each
sequence's attention on its own, positions restarting at 0 per sequence: on the fast path the packed tokens are
already one concatenated stream, and attention runs per group of similar-length rows (`packing.RowGroups`); on HF's
path the rows are concatenated into one packed row with restarting position ids and a block-diagonal causal mask.
Every real token's result is the unpacked one's, up to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from relayrl.models.fast.attention import causal_attention
from relayrl.models.fast.kernels import load_cpu_kernels, rms_norm, rope
from relayrl.models.fast.packing import PaddedPacking, RowGroups, SharedPacking
from relayrl.models.fast.support import (
    Layer,
    backbone_of,
    fast_path_unsupported,
    input_grads_hooked,
    projection,
    read_layer,
)


def use_fast_path(model: nn.Module, fast: bool | None) -> bool:
    """Whether a full-sequence pass takes the fast path: `fast` None when it is exact, False never, True always
    (ValueError with the reason when it cannot)."""
    reason = None if fast is False else fast_path_unsupported(model)
    if fast is True and reason is not None:
        raise ValueError(f"fast=True but the fast backbone forward cannot run: {reason}")
    return fast is not False and reason is None


def backbone_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    *,
    fast: bool | None = None,
    native: bool = False,
    packed: bool = False,
) -> torch.Tensor:
    """Final hidden states [B, S, H] of right-padded rows (after the final norm); fast path when it is exact.

    `fast`: None picks the fast path whenever `fast_path_unsupported` allows it, False forces HF, True raises
    when the fast path is unavailable. Values at positions >= a row's length are unspecified (zero when fast or
    packed). `native`: on a float32 CPU model, the fast path runs RMSNorm and RoPE as relayrl's compiled kernels.
    `packed`: per-sequence attention over the rows as one packed stream (sequence packing).
    """
    if not use_fast_path(model, fast):
        return hf_hidden_states(model, input_ids, input_lengths, packed=packed)
    return fast_hidden_states(model, input_ids, input_lengths, native=native, packed=packed)


def hf_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, input_lengths: torch.Tensor, *, packed: bool = False
) -> torch.Tensor:
    """HF's own forward: attention limited to each row's real tokens, position ids = arange per row (`packed`: the
    rows as one packed row, see `hf_packed_hidden_states`)."""
    if packed:
        return hf_packed_hidden_states(model, input_ids, input_lengths)
    batch, seq = input_ids.shape
    positions = torch.arange(seq, device=input_ids.device)  # [S]
    # Position 0 is always attended so an empty row cannot produce an all-masked (NaN) attention row.
    lengths = input_lengths.to(input_ids.device).clamp(min=1)
    attention_mask = (positions[None, :] < lengths[:, None]).long()  # [B, S]
    base: Any = model.base_model
    out = base(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions.expand(batch, seq), use_cache=False
    )
    return out.last_hidden_state  # [B, S, H]


def hf_packed_hidden_states(model: nn.Module, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """HF's forward on the rows' real tokens concatenated into one row [1, N]: position ids restart at 0 for each
    sequence and an additive block-diagonal causal mask [1, 1, N, N] keeps every sequence to its own earlier tokens
    (eager and SDPA attention both take it). Returns [B, S, H], zeros past each row's length."""
    batch, seq = input_ids.shape
    device = input_ids.device
    cols = torch.arange(seq, device=device)  # [S]
    lengths = input_lengths.to(device).clamp(1, seq)  # [B]: an empty row keeps its first slot, as in hf_hidden_states
    valid = cols[None, :] < lengths[:, None]  # [B, S]
    segment = torch.arange(batch, device=device)[:, None].expand(batch, seq)[valid]  # [N] row of each token
    order = torch.arange(segment.shape[0], device=device)  # [N]
    allowed = (segment[:, None] == segment[None, :]) & (order[:, None] >= order[None, :])  # [N, N]
    base: Any = model.base_model
    dtype = next(base.parameters()).dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    out = base(
        input_ids=input_ids[valid][None],  # [1, N]
        attention_mask=mask[None, None],  # [1, 1, N, N]
        position_ids=cols[None, :].expand(batch, seq)[valid][None],  # [1, N] restarting per sequence
        use_cache=False,
    )
    hidden = out.last_hidden_state[0]  # [N, H]
    return hidden.new_zeros(batch, seq, hidden.shape[-1]).masked_scatter(valid[..., None], hidden)  # [B, S, H]


class _Backbone:
    """One pass's view of the model: its parameter tensors by role and the attention geometry."""

    def __init__(self, base: Any, native: bool = False, packed: bool = False) -> None:
        self.packed = packed  # per-sequence attention groups instead of one [B, S] call
        self.groups: RowGroups | None = None  # the current pass's groups (packed only)
        attn0 = base.layers[0].self_attn
        embed = base.embed_tokens
        self.embed, self.padding_idx = embed.weight, embed.padding_idx  # [V, H]; padding_idx: no gradient
        self.input_requires_grad = input_grads_hooked(embed)
        self.final_norm, self.final_eps = base.norm.weight, base.norm.variance_epsilon
        self.rotary = base.rotary_emb
        self.head_dim = int(attn0.head_dim)
        self.n_heads = attn0.q_proj.out_features // self.head_dim
        self.n_kv = attn0.k_proj.out_features // self.head_dim
        self.group = self.n_heads // self.n_kv
        self.scaling = float(attn0.scaling)
        modules = list(base.layers[: base.config.num_hidden_layers])
        self.layers = [read_layer(m) for m in modules]
        # RMSNorm and RoPE as compiled CPU kernels (forward and backward) for float32 CPU passes.
        self.native = native and self.embed.device.type == "cpu" and load_cpu_kernels()
        # HF checkpoints a decoder layer exactly when its flag is set and it is in training mode, through the
        # function activation checkpointing installed (it carries use_reentrant and CPU offload).
        self.checkpoint_fns: list[Callable[..., Any] | None] = [
            getattr(m, "_gradient_checkpointing_func", _checkpoint)
            if getattr(m, "gradient_checkpointing", False) and m.training
            else None
            for m in modules
        ]

    def forward(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        pk = PaddedPacking(input_lengths, batch, seq, input_ids.device)
        self.groups = pk.row_groups() if self.packed else None
        h = self._run(input_ids, pk, None)  # [N, H]
        return pk.unpack(h)  # [B, S, H]

    def forward_selected(self, input_ids: torch.Tensor, pk: SharedPacking) -> torch.Tensor:
        """Final hidden states [M, H] of the positions `pk` selected, row-major."""
        self.groups = pk.row_groups() if self.packed else None
        h = self._run(input_ids[:, : pk.seq], pk, pk.query_index)  # [Q, H]
        return h.index_select(0, pk.output_index)  # [M, H]

    def _run(
        self, input_ids: torch.Tensor, pk: PaddedPacking | SharedPacking, query: torch.Tensor | None
    ) -> torch.Tensor:
        """Embeddings, decoder layers and final norm on packed tokens; the last layer's queries only at `query`."""
        grad = torch.is_grad_enabled()
        h = F.embedding(pk.pack(input_ids), self.embed, self.padding_idx)  # [N, H]
        if self.input_requires_grad and grad:
            h.requires_grad_(True)  # what HF's hook does to the embedding output (frozen embeddings still backprop)
        cos, sin = self.rotary(h, torch.arange(pk.seq, device=h.device).unsqueeze(0))  # [1, S, D], dtype of h
        half = self.head_dim // 2
        signed_sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [S, D]: rotate_half's sign folded
        cos_n = cos[0].index_select(0, pk.positions).unsqueeze(1)  # [N, 1, D]
        sin_n = signed_sin.index_select(0, pk.positions).unsqueeze(1)  # [N, 1, D]
        last = len(self.layers) - 1
        for i, (layer, ckpt) in enumerate(zip(self.layers, self.checkpoint_fns)):
            q = query if i == last else None
            if ckpt is not None and grad:
                h = ckpt(self._layer, h, layer, cos_n, sin_n, pk, q)
            else:
                h = self._layer(h, layer, cos_n, sin_n, pk, q)
        return rms_norm(h, self.final_norm, self.final_eps, self.native)  # [N or Q, H]

    def _layer(
        self,
        h: torch.Tensor,
        layer: Layer,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pk: PaddedPacking | SharedPacking,
        query: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder layer on packed tokens h [N, H]: pre-norm attention and SwiGLU MLP, each with a residual.

        With `query` [Q], only those tokens continue past attention (every token still provides K/V): [Q, H]."""
        n, d = pk.num_tokens, self.head_dim
        native = self.native
        x = rms_norm(h, layer.in_norm, layer.in_eps, native)  # [N, H]
        q = projection(x, layer.q).view(n, self.n_heads, d)
        k = projection(x, layer.k).view(n, self.n_kv, d)
        v = projection(x, layer.v).view(n, self.n_kv, d)
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm, layer.qk_eps, native), rms_norm(k, layer.k_norm, layer.qk_eps, native)
        a = self._attention(rope(q, cos, sin, native), rope(k, cos, sin, native), v, pk)  # [N, Hq * D]
        if query is not None:
            h, a = h.index_select(0, query), a.index_select(0, query)  # [Q, H], [Q, Hq * D]
        h = h + projection(a, layer.o)
        x = rms_norm(h, layer.post_norm, layer.post_eps, native)
        return h + projection(F.silu(projection(x, layer.gate)) * projection(x, layer.up), layer.down)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: PaddedPacking | SharedPacking
    ) -> torch.Tensor:
        """Causal attention of packed q [N, Hq, D], k/v [N, Hkv, D] within each row; returns [N, Hq * D]."""
        if self.groups is not None:
            return self._grouped_attention(q, k, v, self.groups)
        b, s = pk.batch, pk.seq
        qp = pk.unpack(q).transpose(1, 2)  # [B, Hq, S, D]
        kp = pk.unpack(k).transpose(1, 2)  # [B, Hkv, S, D]
        vp = pk.unpack(v).transpose(1, 2)
        if self.group > 1:
            kp, vp = kp.repeat_interleave(self.group, dim=1), vp.repeat_interleave(self.group, dim=1)
        # Right padding: causality alone keeps real queries off padding keys, so no mask tensor is needed.
        out = causal_attention(qp, kp, vp, self.scaling)  # [B, Hq, S, D]
        return pk.pack(out.transpose(1, 2).reshape(b, s, -1))  # [N, Hq * D]

    def _grouped_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        """`_attention` per group of similar-length rows (packed micro-batches); returns [N, Hq * D]."""
        d, outs = self.head_dim, []
        for gather, rows, width in groups.parts:
            qg = q.index_select(0, gather).view(rows, width, self.n_heads, d).transpose(1, 2)  # [n, Hq, m, D]
            kg = k.index_select(0, gather).view(rows, width, self.n_kv, d).transpose(1, 2)  # [n, Hkv, m, D]
            vg = v.index_select(0, gather).view(rows, width, self.n_kv, d).transpose(1, 2)
            if self.group > 1:
                kg, vg = kg.repeat_interleave(self.group, dim=1), vg.repeat_interleave(self.group, dim=1)
            out = causal_attention(qg, kg, vg, self.scaling)  # [n, Hq, m, D]
            outs.append(out.transpose(1, 2).reshape(rows * width, -1))  # [n*m, Hq * D]
        grouped = torch.cat(outs) if len(outs) > 1 else outs[0]
        return grouped.index_select(0, groups.pack_index)  # [N, Hq * D]


def _checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False)


def fast_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    *,
    native: bool = False,
    packed: bool = False,
) -> torch.Tensor:
    """The fast path itself (call `backbone_hidden_states` unless support was already checked): [B, S, H]."""
    return _Backbone(backbone_of(model), native, packed).forward(input_ids, input_lengths)


def selected_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    select: torch.Tensor,
    *,
    fast: bool | None = None,
    native: bool = False,
    packed: bool = False,
) -> torch.Tensor:
    """Final hidden states [M, H] of the M positions where `select` [B, S] is True (row-major), computing only what
    they depend on (see `packing.SharedPacking`); positions at or past a row's length are never selected.

    `fast`, `native` and `packed` as in `backbone_hidden_states`; the HF path runs the whole batch and picks the
    positions.
    """
    use_fast = use_fast_path(model, fast)
    batch, seq = input_ids.shape
    cols = torch.arange(seq, device=input_ids.device)  # [S]
    select = select.to(input_ids.device).bool() & (cols[None, :] < input_lengths.to(input_ids.device)[:, None])
    if not use_fast:
        return hf_hidden_states(model, input_ids, input_lengths, packed=packed)[select]  # [M, H]
    pk = SharedPacking(input_ids, input_lengths, select)
    backbone = _Backbone(backbone_of(model), native, packed)
    if pk.num_selected == 0:
        return backbone.embed.new_zeros(0, backbone.embed.shape[1])
    return backbone.forward_selected(input_ids, pk)  # [M, H]

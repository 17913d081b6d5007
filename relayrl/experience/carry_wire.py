"""The wire form of the driver carry: what a rollout actually sends to the driver each step, and its size.

The data-plane trainer promises that only per-row scalars and metadata cross the driver, at most a few percent of
what the step writes to the store. With short sequences (the shipped arithmetic task) a plain carry of
int64/float32 columns is already a visible share of the store bytes (docs/design.md has the figures), so the carry
travels in its smallest exact form:

* 0/1 columns (binary reward, loss multiplier, truncated flag) as bits of one `uint8` per row;
* columns constant within each prompt group (the prompt's group id and length) once per prompt, not per row;
* other integers in the smallest dtype that holds them (`uint8`, `int16`, `int32`);
* everything else (fractional rewards, text for sample logging) as it is.

`decode_carry(encode_carry(c, G))` gives back every column with exactly the same values and dtypes, so the trainer
computes on the same numbers either way; `wire_nbytes` is the payload the driver received.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict

_MAX_BITS = 8


def compact_tensor(t: torch.Tensor) -> torch.Tensor:
    """The same values in the smallest exact dtype: 0/1 floats -> bool, small integers -> int16/int32."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return t
    if t.is_floating_point():
        return t.bool() if bool(((t == 0) | (t == 1)).all()) else t
    if t.element_size() > 2 and t.dim() == 1 and int(t.min()) >= -(2**15) and int(t.max()) < 2**15:
        return t.to(torch.int16)
    if t.element_size() > 4 and t.dim() == 1 and int(t.min()) >= -(2**31) and int(t.max()) < 2**31:
        return t.to(torch.int32)
    return t


def _is_binary(v: torch.Tensor) -> bool:
    return v.dtype == torch.bool or (v.dim() == 1 and v.numel() > 0 and bool(((v == 0) | (v == 1)).all()))


def _per_prompt(v: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """`v` [B] as [P] when every prompt group holds one value, else None."""
    if group_size == 1 or v.dim() != 1:
        return None
    grouped = v.view(-1, group_size)  # [P, G]
    return grouped[:, 0].clone() if bool((grouped == grouped[:, :1]).all()) else None


def _small_int(v: torch.Tensor) -> torch.Tensor:
    if not v.is_floating_point() and v.dtype != torch.bool and v.numel() and int(v.min()) >= 0 and int(v.max()) < 256:
        return v.to(torch.uint8)
    return compact_tensor(v)


def encode_carry(carry: Mapping[str, Any], group_size: int) -> dict[str, Any]:
    """The smallest exact wire form of a per-row carry whose `group_size` rows per prompt are contiguous."""
    rows = len(next(iter(carry.values()))) if carry else 0
    if rows % group_size:
        raise ValueError(f"encode_carry: {rows} rows are not a multiple of group_size={group_size}")
    bits: list[str] = []
    flags = torch.zeros(rows, dtype=torch.uint8)  # [B]
    per_prompt: dict[str, torch.Tensor] = {}
    per_row: dict[str, Any] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name, value in carry.items():
        if not isinstance(value, torch.Tensor):
            per_row[name] = value
            continue
        dtypes[name] = value.dtype
        if len(bits) < _MAX_BITS and value.dim() == 1 and _is_binary(value):
            flags |= value.to(torch.uint8) << len(bits)
            bits.append(name)
            continue
        grouped = _per_prompt(value, group_size)
        if grouped is not None:
            per_prompt[name] = _small_int(grouped) if not value.is_floating_point() else grouped
        else:
            per_row[name] = _small_int(value) if not value.is_floating_point() else value
    return {
        "rows": rows,
        "group_size": group_size,
        "order": list(carry),
        "bits": bits,
        "flags": flags if bits else None,
        "per_prompt": per_prompt,
        "per_row": per_row,
        "dtypes": dtypes,
    }


def decode_carry(wire: Mapping[str, Any]) -> BatchedDataDict:
    """Invert `encode_carry`: per-row columns in the original order and dtypes."""
    g = int(wire["group_size"])
    out: dict[str, Any] = {}
    for i, name in enumerate(wire["bits"]):
        out[name] = ((wire["flags"] >> i) & 1).bool()  # [B]
    for name, v in wire["per_prompt"].items():
        out[name] = v.repeat_interleave(g)  # [P] -> [B]
    out.update(wire["per_row"])
    for name, dtype in wire["dtypes"].items():
        out[name] = out[name].to(dtype)
    return BatchedDataDict({name: out[name] for name in wire["order"]})


def wire_nbytes(wire: Mapping[str, Any]) -> int:
    """Payload bytes of a wire carry: tensor storage, UTF-8 text, 8 per number (column names excluded)."""
    return _nbytes(wire["flags"]) + _nbytes(wire["per_prompt"]) + _nbytes(wire["per_row"])


def _nbytes(obj: Any) -> int:
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, str):
        return len(obj.encode("utf-8"))
    if isinstance(obj, bool | int | float):
        return 8
    if isinstance(obj, Mapping):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0

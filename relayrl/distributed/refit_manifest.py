"""The refit manifest and wire format shared by both refit transports (`refit` ZMQ IPC, `refit_collective`).

The manifest `{name: (shape, dtype)}` names every tensor in order with the dtype it travels in; a tensor that is an
earlier one's storage under a second name (tied embeddings) is marked by that earlier name instead: it travels once
and the receiver gets it under both names (`with_ties`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

Entry = tuple[tuple[int, ...], torch.dtype]
#: name -> (shape, dtype it travels in), or the earlier name whose storage it is (a tied tensor: sent once)
RefitInfo = dict[str, Entry | str]
LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]
ALIGN = 512


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two names one tensor: the same bytes seen the same way."""
    t = t.detach()
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def unique_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | str]]:
    """(name, tensor) in order, with a tensor already seen under an earlier name given as that name instead."""
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in named_tensors:
        key = _storage_key(tensor)
        if key in seen:
            yield name, seen[key]
        else:
            seen[key] = name
            yield name, tensor


def refit_info(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> RefitInfo:
    """The manifest of what will be streamed: names in order, shapes and the dtype each tensor is sent in, a tied
    tensor as the name it is sent under."""
    return {
        name: t if isinstance(t, str) else (tuple(t.shape), dtype or t.dtype)
        for name, t in unique_tensors(named_tensors)
    }


def wire_entries(info: RefitInfo) -> dict[str, Entry]:
    """The manifest's tensors that travel (ties left out), in order."""
    return {name: e for name, e in info.items() if not isinstance(e, str)}


def ties(info: RefitInfo) -> dict[str, list[str]]:
    """Sent name -> the other names it is loaded under."""
    out: dict[str, list[str]] = {}
    for name, e in info.items():
        if isinstance(e, str):
            out.setdefault(e, []).append(name)
    return out


def wire_bytes(info: RefitInfo) -> int:
    """Bytes one refit moves (each tied tensor once)."""
    return sum(nbytes(shape, dtype) for shape, dtype in wire_entries(info).values())


def with_ties(batch: list[tuple[str, torch.Tensor]], tied: dict[str, list[str]]) -> list[tuple[str, torch.Tensor]]:
    """A received batch plus every tied name of its tensors (same tensor), for `load_weights`."""
    return [pair for name, t in batch for pair in [(name, t), *((alias, t) for alias in tied.get(name, ()))]]


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def as_bytes(t: torch.Tensor, dtype: torch.dtype | None, device: str = "cpu") -> torch.Tensor:
    """A flat uint8 view of `t` cast to `dtype` (the wire format), on the CPU (or left on its own device)."""
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.contiguous() if device != "cpu" else t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8)


def tensor_from(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """View bytes [offset, offset+nbytes) of `buf` as a tensor; misaligned slices are cloned first."""
    n = nbytes(shape, dtype)
    piece = buf[offset : offset + n]
    if offset % torch.empty((), dtype=dtype).element_size():
        piece = piece.clone()
    return piece.view(dtype).view(shape)


def load_into_module(module: torch.nn.Module) -> LoadFn:
    """A `load_weights` callback copying received tensors into `module`'s state dict entries in place; a tensor
    given under a second name whose entry here is the same storage (tied here too) is copied once."""
    live = module.state_dict(keep_vars=True)

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        done: set[tuple[Any, ...]] = set()
        with torch.no_grad():
            for name, tensor in batch:
                if name not in live:
                    raise KeyError(f"received weight {name!r} has no entry in {type(module).__name__}")
                key = _storage_key(live[name])
                if key not in done:
                    live[name].copy_(tensor)
                    done.add(key)

    return load


def snapshot(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A detached copy of every tensor, each storage once: a tied tensor is the same copy under both names."""
    out: dict[str, torch.Tensor] = {}
    for name, t in unique_tensors(named_tensors):
        out[name] = out[t] if isinstance(t, str) else t.detach().clone()
    return out


def adopt_into_module(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> bool:
    """Point `module`'s parameters and buffers at `state`'s tensors instead of copying them, when every entry
    matches by name, shape, stride, dtype and device; otherwise change nothing and return False (copy instead).
    The caller hands the tensors over: nothing may write them while the module reads them."""
    live = module.state_dict(keep_vars=True)
    if live.keys() != state.keys():
        return False
    for name, t in state.items():
        cur = live[name]
        if (t.shape, t.stride(), t.dtype, t.device) != (cur.shape, cur.stride(), cur.dtype, cur.device):
            return False
    with torch.no_grad():
        for name, t in state.items():
            live[name].data = t.detach()
    return True

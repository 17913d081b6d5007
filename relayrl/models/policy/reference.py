"""The policy worker's frozen reference model: a copy of the loaded weights, its projections in the compute precision.

It stays on the device between steps (the KL term reads it every step; moving a 0.5B fp32 copy each way costs GBs
of copies a step) unless `policy.reference.offload` parks it in host memory. On a GPU it is built in host memory
first, so the full-precision copy never needs device room beside the policy, and it goes to the device only when it
fits there: otherwise set-up stops with one line naming `policy.reference.offload`, not a CUDA out-of-memory error
at some later step.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
from torch import nn

from relayrl.models.worker_base import move_module

M = TypeVar("M", bound=nn.Module)

#: Device memory left free beside the reference (activations, the allocator's slack), as a share of what is free.
HEADROOM = 0.1


class ReferenceDoesNotFitError(ValueError):
    """The reference model would not fit on the device beside the policy (set-up's one line, exit 2)."""


def compact(model: nn.Module, dtype: torch.dtype) -> None:
    """Store a frozen model's `nn.Linear` weights and biases in `dtype` (bfloat16 / float16; float32: unchanged).

    Its passes run under autocast, which rounds exactly these tensors to `dtype` before every product, so the values
    are the same and the copy takes half the memory. A head tied to the embeddings gets its own copy: the lookup
    keeps reading float32 embeddings, as autocast leaves them."""
    if dtype == torch.float32:
        return
    embeddings: Any = getattr(model, "get_input_embeddings", None)
    tied = embeddings().weight if embeddings is not None else None
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        if module.weight is tied:
            module.weight = nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
        module.to(dtype)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, a tensor shared by several names counted once."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def fits(need: int, free: int) -> bool:
    """Whether `need` bytes fit in `free` with `HEADROOM` of it left over."""
    return need <= free * (1 - HEADROOM)


def does_not_fit(need: int, free: int, device: torch.device) -> str:
    """The one line set-up stops with when the reference does not fit: its size, the room, and what to set."""
    gib = 2**30
    return (
        f"policy.reference: the reference model needs {need / gib:.2f} GiB on {device} and {free / gib:.2f} GiB are "
        "free there beside the policy; set policy.reference.offload=true (host memory, moved over for each "
        "reference pass) or policy.precision=bfloat16 (a half-size reference)"
    )


def host_copy(model: M) -> M:
    """A frozen copy of `model` whose parameters live in host memory (ties kept); buffers are copied where they are."""
    memo: dict[int, Any] = {
        id(p): nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=False) for p in model.parameters()
    }
    return copy.deepcopy(model, memo).eval().requires_grad_(False)


def build_reference(model: M, dtype: torch.dtype, device: torch.device, *, offload: bool) -> M:
    """The frozen reference of `model`: in `device` memory (host memory with `offload`), projections in `dtype`."""
    if device.type != "cuda":  # nothing to protect: the copy is made where it will live
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        compact(ref, dtype)
        move_module(ref, torch.device("cpu") if offload else device)
        return ref
    ref = host_copy(model)
    compact(ref, dtype)
    if offload:
        move_module(ref, torch.device("cpu"))  # the buffers too
        return ref
    need, (free, _total) = module_bytes(ref), torch.cuda.mem_get_info(device)
    if not fits(need, free):
        raise ReferenceDoesNotFitError(does_not_fit(need, free, device))
    try:
        move_module(ref, device)
    except torch.cuda.OutOfMemoryError:  # the headroom was not enough after all
        raise ReferenceDoesNotFitError(does_not_fit(need, torch.cuda.mem_get_info(device)[0], device)) from None
    return ref

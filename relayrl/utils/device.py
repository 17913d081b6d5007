"""Device selection and the few device-specific calls the workers make.

This is the only module that mentions CUDA, so the rest of the code runs unchanged on a CPU-only machine and every
"is there a GPU?" decision is made (and can be tested) in one place.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from collections.abc import Iterator
from typing import Literal

import torch

from relayrl.utils.seeding import deterministic_algorithms

Precision = Literal["float32", "bfloat16", "float16"]

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def select_device(preference: str = "auto", local_rank: int = 0) -> torch.device:
    """The device a worker of `local_rank` computes on: `auto` takes a GPU when one is visible, else the CPU."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"cluster.device must be 'auto', 'cpu' or 'cuda', got {preference!r}")
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("cluster.device is 'cuda' but torch sees no CUDA device (CPU-only torch build or no GPU)")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def is_accelerator(device: torch.device) -> bool:
    """True when tensors on `device` live off the host (moves are real copies, caches are worth emptying)."""
    return device.type == "cuda"


def precision_dtype(precision: str) -> torch.dtype:
    """torch dtype of a `policy.precision` string."""
    if precision not in _DTYPES:
        raise ValueError(f"policy.precision must be one of {sorted(_DTYPES)}, got {precision!r}")
    return _DTYPES[precision]


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Run the forward in `precision` while the master weights stay float32 (no-op for float32)."""
    dtype = precision_dtype(precision)
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def empty_cache(device: torch.device, enabled: bool = True) -> None:
    """Return cached allocator blocks to the driver after a phase change, when `enabled` (no-op on CPU).

    Off by default in the workers (`policy.empty_cache_between_phases`): re-allocating the KV cache and activations
    every step costs more than keeping them, and torch's allocator already frees its cache and retries before it
    reports out-of-memory."""
    if enabled and is_accelerator(device):
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    """Human-readable name of the worker's device, for worker reports."""
    if is_accelerator(device):
        return torch.cuda.get_device_name(device)
    return "cpu"


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move every tensor of the optimizer state (Adam moments, step counters) to `device` in place."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device:
                state[key] = value.to(device, non_blocking=False)


def apply_runtime_settings(
    deterministic: bool = False, num_threads: int | None = None, retain_freed_memory: bool = True
) -> None:
    """Process-wide settings from `cluster.*`: bitwise-reproducible kernels, intra-op thread count, heap reuse.

    Only switches things on: a policy built without `deterministic` leaves a caller's global choice alone.
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if retain_freed_memory:
        retain_freed_heap_memory()
    if deterministic:
        # cuBLAS needs a fixed workspace for deterministic GEMMs; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        deterministic_algorithms()


#: glibc mallopt parameters (malloc.h) and the values `retain_freed_heap_memory` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's maximum on 64-bit: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD_BYTES = 2**30  # keep up to 1 GiB of free memory at the top of the heap instead of unmapping it
_heap_retained: bool | None = None


def retain_freed_heap_memory() -> bool:
    """Keep freed tensor buffers of up to 32 MiB mapped for reuse (glibc); returns whether the setting is in effect.

    Why: glibc's defaults hand multi-MB blocks back to the OS when they are freed (mmap threshold, heap trimming),
    so a CPU training step page-faults its activation buffers in again every time (docs/design.md has the cost at
    the shape of `bench/trl_vs_relayrl.py`). The same idea as running PyTorch on CPU under jemalloc or tcmalloc,
    without preloading a library. Process-wide, set once; a no-op off glibc.
    """
    global _heap_retained
    if _heap_retained is None:
        _heap_retained = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL("libc.so.6")
                ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                _heap_retained = ok and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
            except (OSError, AttributeError):
                _heap_retained = False
    return _heap_retained


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """`fused=True` when torch has a fused AdamW for these parameters (float32/bf16 on CPU or CUDA): one kernel
    instead of a Python loop over tensors, which dominates the optimizer step of small models."""
    ok = all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params) and all(
        p.device.type in ("cpu", "cuda") for p in params
    )
    return {"fused": True} if ok else {}

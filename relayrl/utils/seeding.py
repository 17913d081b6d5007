"""Seeding and RNG-state capture, so a resumed run draws exactly the random numbers the original would have.

`capture_rng_state` returns only plain Python values and tensors, so a checkpoint stores it exactly with
`relayrl.utils.checkpoint.save_state_file` (safetensors + JSON; nothing is pickled).
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from typing import Any

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds all CUDA devices (lazily, if CUDA is initialised later)


def capture_rng_state() -> dict[str, Any]:
    """Snapshot every global generator we seed: python, numpy, torch CPU and (when available) CUDA."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": _to_lists(random.getstate()),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():  # this process computes on a GPU; a Ray driver never opens a CUDA context
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back a snapshot from `capture_rng_state`; generators absent from it are left untouched."""
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in state:
        ns = state["numpy"]
        key = ns["key"].numpy() if isinstance(ns["key"], torch.Tensor) else np.asarray(ns["key"])
        np.random.set_state((ns["bit_generator"], key.astype(np.uint32), ns["pos"], ns["has_gauss"], ns["gauss"]))
    if "torch" in state:
        torch.set_rng_state(_as_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [_as_byte_tensor(s) for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            warnings.warn(
                f"saved RNG state covers {len(cuda_states)} CUDA devices but {torch.cuda.device_count()} are "
                "visible; CUDA generators were not restored",
                stacklevel=2,
            )


def enable_determinism(warn_only: bool = False) -> None:
    """Make torch pick deterministic kernels (needed for bit-exact resume and CPU/GPU parity tests).

    Sets CUBLAS_WORKSPACE_CONFIG if unset (cuBLAS needs it before its first use), disables cuDNN autotuning, and
    turns on `torch.use_deterministic_algorithms`: operations without a deterministic kernel then raise
    (or only warn, with `warn_only`).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    deterministic_algorithms(warn_only=warn_only)


def deterministic_algorithms(warn_only: bool = False) -> None:
    """`torch.use_deterministic_algorithms(True)` without importing `torch._inductor`, which it does only to set
    inductor's `deterministic` flag: a second of CPU in every fresh process (each Ray rank and generation worker,
    each CLI run). Inductor reads that flag from TORCHINDUCTOR_DETERMINISTIC when first imported, and is set
    directly when it already is: the same state as torch's own call."""
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True  # type: ignore[attr-defined]
    else:
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    torch._C._set_deterministic_algorithms(True, warn_only=warn_only)


def _to_lists(value: Any) -> Any:
    """Tuples -> lists, recursively (Python's random state is nested tuples)."""
    if isinstance(value, tuple | list):
        return [_to_lists(v) for v in value]
    return value


def _as_byte_tensor(value: Any) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return t.to(device="cpu", dtype=torch.uint8)

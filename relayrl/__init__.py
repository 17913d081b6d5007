"""relayrl: RL post-training of language models with a sample-keyed data plane.

Kept import-light on purpose: `relayrl --help` and config validation must not pay for torch. `relayrl.train`,
`relayrl.load_config` and `relayrl.TrainResult` are imported on first use.
"""

from __future__ import annotations

import os
from typing import Any

# Intel MKL (torch's CPU BLAS) picks its GEMM/GEMV code by the operands' memory alignment when a product has 1-3
# rows, as in decoding, so one product gave results an ulp apart for a weight loaded from safetensors (8 bytes past a
# 64-byte boundary) and for its aligned copy in another engine: the same run then logged different metrics. MKL's
# strict reproducibility mode removes the dependence at no measured cost. MKL reads it once, at its first call, so it
# is set here, before any product (a value the user set wins; the variable is harmless without MKL).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
__all__ = ["TrainResult", "__version__", "load_config", "train"]

_LAZY = {
    "train": ("relayrl.algorithms.api", "train"),
    "TrainResult": ("relayrl.algorithms.api", "TrainResult"),
    "load_config": ("relayrl.utils.config_io", "load_config"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'relayrl' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])

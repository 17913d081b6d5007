"""relayrl's compiled CPU kernels (csrc/cpu_kernels.cpp): built on first use, cached, optional.

Why: a small model's decode step on CPU is bound by the dispatch of ~400 PyTorch ops, not by arithmetic; one
compiled call per step (matrix products still through ATen/MKL) cuts the step by a third at the sizes CPU RL runs
at. The same library holds the inverse-CDF sampler and the RMSNorm / RoPE forward and backward kernels of the
policy's full-sequence passes (`torch.ops.relayrl_cpu.*`).
The library is compiled with the C++ toolchain torch uses for extensions (a C++ compiler and `ninja`), once per
source, torch version and instruction set, into `~/.cache/relayrl/cpu_kernels/` (override with
RELAYRL_KERNEL_CACHE); later processes only load it. When it cannot be built, `load_cpu_kernels()` returns None with
a one-line reason logged, and generation keeps the PyTorch formulation. RELAYRL_CPU_KERNELS=0 turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

_LOG = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _isa_flags() -> list[str]:
    """AVX2 + FMA code when this CPU has them (the cache key includes the choice), else the compiler's default."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(flags) else []


def _build_dir(cflags: list[str]) -> Path:
    key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + " ".join(cflags).encode()).hexdigest()
    root = Path(os.environ.get("RELAYRL_KERNEL_CACHE", Path.home() / ".cache" / "relayrl" / "cpu_kernels"))
    return root / key[:16]


def load_cpu_kernels() -> bool:
    """Build (first time only) and load the `torch.ops.relayrl_cpu` kernels; False when unavailable here."""
    with _LOCK:
        if "ok" not in _STATE:
            loaded = hasattr(torch.ops, "relayrl_cpu") and hasattr(torch.ops.relayrl_cpu, "decode_step")
            _STATE["ok"] = loaded or _load()
        return bool(_STATE["ok"])


def _load() -> bool:
    if os.environ.get("RELAYRL_CPU_KERNELS", "1").strip().lower() in {"0", "false", "off", "no"}:
        return False
    cflags = ["-O3", "-fopenmp-simd", "-ffp-contract=off", *_isa_flags()]
    try:
        from torch.utils.cpp_extension import load

        build = _build_dir(cflags)
        build.mkdir(parents=True, exist_ok=True)
        if not (build / "relayrl_cpu_kernels.so").exists():  # say why this first call pauses
            print(f"relayrl: building CPU kernels once (~15 s) into {build}", file=sys.stderr, flush=True)
        load(
            name="relayrl_cpu_kernels",
            sources=[str(_SOURCE)],
            extra_cflags=cflags,
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler / ninja, or a failed build: generation keeps the PyTorch ops
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _LOG.warning("relayrl: compiled CPU kernels unavailable (%s); using PyTorch ops", reason[:200])
        return False
    return True

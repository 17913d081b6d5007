"""relayrl's compiled CPU kernels (csrc/cpu_kernels.cpp), and the RMSNorm / RoPE ops that use them when they can.

Why: a small model's decode step on CPU is bound by the dispatch of ~400 PyTorch ops, not by arithmetic; one
compiled call per step (matrix products still through ATen/MKL) cuts the step by a third at the sizes CPU RL runs
at. The same library holds the inverse-CDF sampler and the RMSNorm / RoPE forward and backward kernels of the
policy's full-sequence passes (`torch.ops.relayrl_cpu.*`).
The library is compiled with the C++ toolchain torch uses for extensions (a C++ compiler and `ninja`), once per
source, torch version and instruction set, into `~/.cache/relayrl/cpu_kernels/<key>/` (override with
RELAYRL_KERNEL_CACHE); later processes only load it. When it cannot be built, `load_cpu_kernels()` returns False
with a one-line reason logged, and callers keep the PyTorch formulation. RELAYRL_CPU_KERNELS=0 turns it off.

No process ever waits forever on another's build. The library appears in the cache only through an atomic rename
of a finished build, so a present file is complete and loading it takes no lock. A build runs in a child process
(killed past RELAYRL_KERNEL_BUILD_TIMEOUT_S, default 600 s) inside a private temporary directory, while its
process holds an flock on `<key>/build.flock`: the kernel releases that lock when its holder dies, kill -9
included, so a killed build leaves nothing that blocks the next one (which removes the killed one's temporary
directory); processes starting at the same time wait for one build instead of compiling side by side, and give up
after the same time-out with a one-line message. torch's own `lock` file (its `load()` waits on it forever when a
build was killed) is never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from relayrl.models.fast.support import native_head_dim, native_tensors

_LOG = logging.getLogger(__name__)
#: The kernels' source; its bytes are part of the build cache key.
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
LIBRARY = "relayrl_cpu_kernels.so"
BUILD_LOCK = "build.flock"
_TMP_PREFIX = ".build-"
DEFAULT_BUILD_TIMEOUT_S = 600.0


def _isa_flags() -> list[str]:
    """AVX2 + FMA code when this CPU has them (the cache key includes the choice), else the compiler's default."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(flags) else []


def build_dir(cflags: list[str]) -> Path:
    """The cache folder of one build: keyed by the source, the torch version and the compiler flags."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(cflags).encode()).hexdigest()
    root = Path(os.environ.get("RELAYRL_KERNEL_CACHE", Path.home() / ".cache" / "relayrl" / "cpu_kernels"))
    return root / key[:16]


def load_cpu_kernels() -> bool:
    """Build (first time only) and load the `torch.ops.relayrl_cpu` kernels; False when unavailable here."""
    with _LOCK:
        if "ok" not in _STATE:
            loaded = hasattr(torch.ops, "relayrl_cpu") and hasattr(torch.ops.relayrl_cpu, "decode_step")
            _STATE["ok"] = loaded or build_and_load()
        return bool(_STATE["ok"])


def build_and_load() -> bool:
    """One uncached attempt (`load_cpu_kernels` remembers the answer): False, with one warning line, on failure."""
    if os.environ.get("RELAYRL_CPU_KERNELS", "1").strip().lower() in {"0", "false", "off", "no"}:
        return False
    cflags = ["-O3", "-fopenmp-simd", "-ffp-contract=off", *_isa_flags()]
    try:
        library = build_dir(cflags) / LIBRARY
        if library.exists():
            try:
                torch.ops.load_library(str(library))
                return True
            except OSError:  # damaged (an older relayrl's build killed while linking in place): rebuilt below
                library.unlink(missing_ok=True)
        _build(library, cflags, _build_timeout_s())
        torch.ops.load_library(str(library))
    except Exception as exc:  # no compiler / ninja, a failed build, a time-out: callers keep the PyTorch ops
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _LOG.warning("relayrl: compiled CPU kernels unavailable (%s); using PyTorch ops", reason[:200])
        return False
    return True


def _build_timeout_s() -> float:
    raw = os.environ.get("RELAYRL_KERNEL_BUILD_TIMEOUT_S", "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_BUILD_TIMEOUT_S
    except ValueError:
        raise ValueError(f"RELAYRL_KERNEL_BUILD_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    return value if value > 0 else DEFAULT_BUILD_TIMEOUT_S


def _build(library: Path, cflags: list[str], timeout_s: float) -> None:
    """Publish a freshly built `library` (unless a concurrent build did while this one waited for the lock)."""
    folder = library.parent
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    fd = os.open(folder / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _flock_until(fd, folder, deadline, timeout_s)
        if library.exists():  # built by the process this one waited for
            return
        for stale in folder.glob(f"{_TMP_PREFIX}*"):  # the lock holder alone builds: these are killed builds'
            shutil.rmtree(stale, ignore_errors=True)
        print(f"relayrl: building CPU kernels once (~15 s) into {folder}", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=folder))
        try:
            _compile(tmp, cflags, max(1.0, deadline - time.monotonic()))
            os.replace(tmp / LIBRARY, library)  # atomic: the cache holds a complete library or none
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.close(fd)  # releases the flock


def _flock_until(fd: int, folder: Path, deadline: float, timeout_s: float) -> None:
    """Take the build lock, polling until `deadline`; then record this process as the builder."""
    import fcntl

    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                raise TimeoutError(
                    f"{holder} has been building them in {folder} for over {timeout_s:g}s "
                    "(RELAYRL_KERNEL_BUILD_TIMEOUT_S)"
                ) from None
            time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)


_COMPILE = """
import json, sys
from torch.utils.cpp_extension import load
a = json.loads(sys.argv[1])
load(name="relayrl_cpu_kernels", sources=[a["source"]], extra_cflags=a["cflags"], build_directory=a["dir"],
     is_python_module=False, verbose=False)
"""


def _compile(directory: Path, cflags: list[str], timeout_s: float) -> None:
    """Build the library into `directory` in a child process (its own session, killed whole past `timeout_s`)."""
    args = json.dumps({"source": str(SOURCE), "cflags": cflags, "dir": str(directory)})
    proc = subprocess.Popen(
        [sys.executable, "-c", _COMPILE, args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the compiler and ninja too go with a kill of the group
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"building them took over {timeout_s:g}s (RELAYRL_KERNEL_BUILD_TIMEOUT_S)") from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0 or not (directory / LIBRARY).exists():
        lines = [ln.strip() for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        compiler = [ln for ln in lines if ": error:" in ln or ln.startswith("error:")]  # the first compiler error
        raise RuntimeError((compiler or lines[-1:] or [f"build exited with code {proc.returncode}"])[0])


# ------------------------------------------------------------------------------------- RMSNorm and RoPE
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's sign folded into `signed_sin` (one roll, no cat)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class _CpuRmsNorm(torch.autograd.Function):
    """`_rms` for float32 CPU tensors as compiled forward and backward kernels."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, inv = torch.ops.relayrl_cpu.rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, inv)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, inv = ctx.saved_tensors
        dx, dw = torch.ops.relayrl_cpu.rms_norm_bwd(grad, x, weight, inv)
        return dx, dw, None


class _CpuRope(torch.autograd.Function):
    """`_rope` of x [N, heads, D] with per-token tables [N, 1, D], forward and backward compiled."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return torch.ops.relayrl_cpu.rope(x, cos, signed_sin, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, signed_sin = ctx.saved_tensors
        return torch.ops.relayrl_cpu.rope(grad, cos, signed_sin, True), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool = False) -> torch.Tensor:
    """HF's RMSNorm over the last dim; compiled when `native` (the caller checked that the kernels load) and x and
    weight are float32 CPU tensors, else PyTorch ops (same values to float32 rounding)."""
    if native and native_tensors(x, weight):
        return _CpuRmsNorm.apply(x, weight, eps)
    return _rms(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, native: bool = False) -> torch.Tensor:
    """RoPE of x [..., D] with tables broadcasting to it; compiled when `native`, x is [N, heads, D] with tables
    [N, 1, D] and everything is float32 CPU, else PyTorch ops."""
    if native and native_head_dim(x.shape[-1]) and native_tensors(x, cos, signed_sin):
        return _CpuRope.apply(x, cos.contiguous(), signed_sin.contiguous())
    return _rope(x, cos, signed_sin)

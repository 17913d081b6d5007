"""Building the CPU kernels never hangs: a build killed midway (kill -9) leaves nothing that blocks the next
load, waiting for another live build and the build itself have a time-out ending in one warning line, and the
cache holds a complete library or none."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.models.fast import kernels

HAVE_TOOLCHAIN = (
    shutil.which(os.environ.get("CXX", "c++")) is not None and importlib.util.find_spec("ninja") is not None
)
needs_toolchain = pytest.mark.skipif(not HAVE_TOOLCHAIN, reason="no C++ compiler / ninja to build with")

_LOAD = (
    "import time; t = time.monotonic(); from relayrl.models.fast import kernels; "
    "ok = kernels.load_cpu_kernels(); print('loaded' if ok else 'fell back', round(time.monotonic() - t, 1))"
)
CFLAGS = ["-O3", "-fopenmp-simd", "-ffp-contract=off", *kernels._isa_flags()]


def _folder(cache: Path) -> Path:
    old = os.environ.get("RELAYRL_KERNEL_CACHE")
    os.environ["RELAYRL_KERNEL_CACHE"] = str(cache)
    try:
        return kernels.build_dir(CFLAGS)
    finally:
        if old is None:
            del os.environ["RELAYRL_KERNEL_CACHE"]
        else:
            os.environ["RELAYRL_KERNEL_CACHE"] = old


def _load_in_fresh_process(cache: Path, bound_s: float) -> str:
    env = dict(os.environ, RELAYRL_KERNEL_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=bound_s)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@needs_toolchain
def test_a_stale_build_lock_does_not_block_the_next_load(tmp_path: Path) -> None:
    """What a build killed with kill -9 leaves - torch's `lock` file (on which torch's own `load()` waits for
    ever), a build lock file naming the dead process, a half-written temporary build - and no library: a new
    process builds and loads within a bound, and cleans the debris up."""
    folder = _folder(tmp_path)
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")
    (folder / kernels.BUILD_LOCK).write_text("pid 999999")
    dead = folder / f"{kernels._TMP_PREFIX}killed"
    dead.mkdir()
    (dead / "cpu_kernels.o").write_bytes(b"\0" * 100)
    start = time.monotonic()
    assert _load_in_fresh_process(tmp_path, bound_s=300).startswith("loaded")
    assert time.monotonic() - start < 300
    assert (folder / kernels.LIBRARY).is_file() and not dead.exists()
    assert not list(folder.glob(f"{kernels._TMP_PREFIX}*"))
    # the next process only loads: no lock of any kind is consulted for a published library
    assert _load_in_fresh_process(tmp_path, bound_s=120).startswith("loaded")


@pytest.mark.slow
@needs_toolchain
def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(tmp_path: Path) -> None:
    """kill -9 of a process in the middle of its build (its compiler running), then a new process: it loads."""
    folder = _folder(tmp_path)
    env = dict(os.environ, RELAYRL_KERNEL_CACHE=str(tmp_path))
    first = subprocess.Popen([sys.executable, "-c", _LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not any(p.is_dir() and any(p.iterdir()) for p in folder.glob(f"{kernels._TMP_PREFIX}*")):
        assert time.monotonic() < deadline and first.poll() is None, "the build never started"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    assert not (folder / kernels.LIBRARY).exists()  # nothing half-built was published
    assert _load_in_fresh_process(tmp_path, bound_s=300).startswith("loaded")
    assert (folder / kernels.LIBRARY).is_file()


def test_waiting_for_a_live_build_gives_up_with_one_line(tmp_path, monkeypatch, caplog) -> None:
    """Another live process holds the build lock longer than RELAYRL_KERNEL_BUILD_TIMEOUT_S: this one falls back
    to PyTorch ops after the time-out, with one warning line naming the holder."""
    folder = _folder(tmp_path)
    folder.mkdir(parents=True)
    hold = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.pwrite(fd, f'pid {os.getpid()}'.encode(), 0); "
        "print('ready', flush=True); time.sleep(300)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(folder / kernels.BUILD_LOCK)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"ready"
        monkeypatch.setenv("RELAYRL_KERNEL_CACHE", str(tmp_path))
        monkeypatch.setenv("RELAYRL_KERNEL_BUILD_TIMEOUT_S", "1")
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            assert kernels.build_and_load() is False
        assert time.monotonic() - start < 15
    finally:
        holder.kill()
        holder.wait(timeout=30)
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"pid {holder.pid} has been building them in {folder} for over 1s" in message
    assert "RELAYRL_KERNEL_BUILD_TIMEOUT_S" in message and message.endswith("using PyTorch ops")


def test_a_build_past_its_time_out_is_killed_with_one_line(tmp_path, monkeypatch, caplog) -> None:
    """A compiler that never finishes (here: a build step that sleeps) is killed at the time-out, whole process
    group included; nothing is published and the temporary build directory is gone."""
    monkeypatch.setattr(kernels, "_COMPILE", "import time\ntime.sleep(300)\n")
    monkeypatch.setenv("RELAYRL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("RELAYRL_KERNEL_BUILD_TIMEOUT_S", "1")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.build_and_load() is False
    assert time.monotonic() - start < 15
    (message,) = [r.getMessage() for r in caplog.records]
    assert "building them took over 1s (RELAYRL_KERNEL_BUILD_TIMEOUT_S)" in message and "\n" not in message
    folder = _folder(tmp_path)
    assert not (folder / kernels.LIBRARY).exists() and not list(folder.glob(f"{kernels._TMP_PREFIX}*"))

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from relayrl.utils.seeding import capture_rng_state, enable_determinism, restore_rng_state, set_seed


def _draw() -> tuple[list[float], list[float], list[float], float]:
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [float(np.random.normal())],
        torch.rand(3).tolist(),
        float(torch.randn(()).item()),
    )


def test_set_seed_makes_all_generators_repeat() -> None:
    set_seed(123)
    first = _draw()
    set_seed(123)
    assert _draw() == first
    set_seed(124)
    assert _draw() != first


def test_set_seed_accepts_large_seed() -> None:
    set_seed(2**40 + 7)  # numpy only takes 32-bit seeds
    a = np.random.rand()
    set_seed(2**40 + 7)
    assert np.random.rand() == a


def test_capture_restore_round_trip() -> None:
    set_seed(7)
    _draw()
    random.gauss(0, 1)  # leave a cached gauss value in python's and numpy's state
    np.random.normal()
    state = capture_rng_state()
    expected = _draw()
    _draw()  # advance further
    restore_rng_state(state)
    assert _draw() == expected


def test_state_survives_weights_only_torch_load(tmp_path: Path) -> None:
    set_seed(11)
    state = capture_rng_state()
    expected = _draw()
    torch.save(state, tmp_path / "rng.pt")
    set_seed(999)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draw() == expected


def test_restore_partial_state_leaves_other_generators() -> None:
    set_seed(5)
    state = capture_rng_state()
    expected_torch = torch.rand(2).tolist()
    set_seed(6)
    np_expected = np.random.rand(2).tolist()
    set_seed(6)
    restore_rng_state({"torch": state["torch"]})
    assert torch.rand(2).tolist() == expected_torch
    assert np.random.rand(2).tolist() == np_expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_round_trip() -> None:
    torch.rand(1, device="cuda")  # a process that computes on the GPU has its CUDA context
    set_seed(3)
    state = capture_rng_state()
    expected = torch.rand(4, device="cuda").tolist()
    torch.rand(4, device="cuda")
    restore_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == expected


def test_a_process_without_a_cuda_context_never_opens_one_for_its_rng_state(monkeypatch) -> None:
    """A Ray driver on a GPU node captures the RNG state for every checkpoint; reading CUDA's generators would open
    a context on every GPU (and fail under EXCLUSIVE_PROCESS). Only a process that already uses CUDA reads them."""

    def opens_a_context() -> list[torch.Tensor]:
        raise AssertionError("get_rng_state_all opened a CUDA context")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node ...
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # ... whose driver process never used it
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", opens_a_context)
    state = capture_rng_state()
    assert "cuda" not in state and set(state) == {"python", "numpy", "torch"}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(AssertionError, match="opened a CUDA context"):  # a GPU worker's process still saves them
        capture_rng_state()


def test_enable_determinism_sets_torch_flags() -> None:
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn_before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        enable_determinism()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        enable_determinism(warn_only=True)
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn_before


@pytest.mark.parametrize("inductor_first", [False, True], ids=["fresh_process", "inductor_imported"])
def test_deterministic_kernels_leave_torch_as_its_own_call_does(inductor_first: bool) -> None:
    """A fresh process (a Ray rank, a CLI run) switches determinism on without importing torch._inductor, and
    inductor, imported before or after, ends with `deterministic` set as `torch.use_deterministic_algorithms` would
    leave it."""
    import os
    import subprocess
    import sys

    code = (
        "import os, sys, torch\n"
        + ("import torch._inductor.config\n" if inductor_first else "")
        + "from relayrl.utils.device import apply_runtime_settings\n"
        "apply_runtime_settings(deterministic=True)\n"
        "imported = 'torch._inductor' in sys.modules\n"
        "import torch._inductor.config as c\n"
        "print(imported, torch.are_deterministic_algorithms_enabled(), c.deterministic,\n"
        "      torch.is_deterministic_algorithms_warn_only_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_DETERMINISTIC"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(inductor_first), "True", "True", "False"]

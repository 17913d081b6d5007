"""State files (utils/state_file.py): checkpoint state in safetensors + JSON round-trips exactly, and nothing
executable is ever read back (a crafted pickle is refused without running)."""

from __future__ import annotations

import math
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from relayrl.utils.checkpoint import DATALOADER_STATE, RNG_STATE, CheckpointError
from relayrl.utils.seeding import capture_rng_state, restore_rng_state
from relayrl.utils.state_file import NonFiniteStateError, assert_finite_state, load_state_file, save_state_file
from tests.helpers import RunsCode


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (tensors: dtype, shape and bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k, k2) and _same(a[k], b[k2]) for k, k2 in zip(a, b, strict=True))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def test_state_file_round_trips_exactly(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    torch.rand(5, generator=gen)
    state = {
        "_sampler_iter_state": {
            "samples_yielded": 32,
            "sampler_iter_state": {"yielded": 32, "generator": gen.get_state()},
        },
        "_index_sampler_state": None,
        "_iterator_finished": False,
        "ratio": 0.1 + 0.2,
        "weird_floats": [float("nan"), float("inf"), -float("inf"), -0.0, 5e-324],
        "big": 2**100,
        "tuple": (1, ("a", None), [2.5]),
        3: "int key",
        ("k", 1): "tuple key",
        "__tuple__": "a key that looks like a tag",
        "nested_tag": {"__tensor__": "t0"},
        "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3, dtype=torch.int64),
        "scalar": torch.tensor(3.0),
        "arr": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "np_scalar": np.float32(0.1),
        "np_int": np.int64(-3),
    }
    save_state_file(tmp_path / "s.safetensors", state)
    assert _same(load_state_file(tmp_path / "s.safetensors"), state)


def test_rng_state_through_a_state_file_resumes_every_generator(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gauss_next: part of the state
    np.random.normal()
    gen = torch.Generator().manual_seed(4)
    save_state_file(tmp_path / RNG_STATE, {"global": capture_rng_state(), "generation": gen.get_state()})
    expected = ([random.random(), random.gauss(0, 1)], np.random.rand(3).tolist(), torch.rand(3).tolist())
    expected_gen = torch.rand(3, generator=gen).tolist()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    loaded = load_state_file(tmp_path / RNG_STATE)
    restore_rng_state(loaded["global"])
    gen2 = torch.Generator()
    gen2.set_state(loaded["generation"])
    assert ([random.random(), random.gauss(0, 1)], np.random.rand(3).tolist(), torch.rand(3).tolist()) == expected
    assert torch.rand(3, generator=gen2).tolist() == expected_gen


def test_state_file_refuses_what_it_cannot_restore(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['gen'\]"):
        save_state_file(tmp_path / "x.safetensors", {"gen": torch.Generator()})
    with pytest.raises(TypeError, match="object"):
        save_state_file(tmp_path / "x.safetensors", {"a": object()})


@pytest.mark.parametrize("writer", ["pickle", "torch_save"])
def test_crafted_pickle_state_file_is_refused_without_running_it(tmp_path: Path, writer: str) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / DATALOADER_STATE
    if writer == "pickle":
        path.write_bytes(pickle.dumps(RunsCode(marker)))
    else:
        torch.save({"state": RunsCode(marker)}, path)
    with pytest.raises(CheckpointError) as err:
        load_state_file(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message and "refusing" in message
    assert not marker.exists()


def test_state_file_refuses_other_files(tmp_path: Path) -> None:
    import safetensors.torch

    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"x": torch.ones(2)}, str(foreign))  # valid safetensors, not a state file
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx")
    bad_tree = tmp_path / "bad_tree.safetensors"
    safetensors.torch.save_file({}, str(bad_tree), metadata={"format": "relayrl-state", "version": "1", "tree": "{"})
    for path in (foreign, garbage, bad_tree, tmp_path / "missing.safetensors"):
        with pytest.raises(CheckpointError, match=re.escape(str(path))):
            load_state_file(path)


def test_assert_finite_state_hook() -> None:
    ok = {"w": torch.ones(3), "ids": torch.tensor([1, 2]), "mask": torch.tensor([True])}
    assert_finite_state(ok, "policy weights")
    assert_finite_state(list(ok.items()), "policy weights")
    bad = {"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")]), "c": torch.tensor([float("-inf")])}
    with pytest.raises(NonFiniteStateError, match=r"policy weights: NaN or infinity in 2 of 3 tensors \(b, c\)"):
        assert_finite_state(bad, "policy weights")
    assert issubclass(NonFiniteStateError, CheckpointError)


def test_a_state_file_whose_header_length_starts_with_0x80_is_read(tmp_path):
    """A safetensors file begins with its header length (little endian): when that length's low byte is 0x80 the
    file starts like a pickle and must still load (a Ray run's RNG state hit this)."""
    import torch

    from relayrl.utils.state_file import load_state_file, save_state_file

    for pad in range(300):  # vary the JSON tree until the header length's low byte is 0x80
        state = {"pad": "x" * pad, "t": torch.arange(3)}
        path = tmp_path / f"s{pad}.safetensors"
        save_state_file(path, state)
        if path.read_bytes()[:1] == b"\x80":
            loaded = load_state_file(path)
            assert loaded["pad"] == state["pad"] and torch.equal(loaded["t"], state["t"])
            return
    raise AssertionError("no header length with low byte 0x80 in 300 tries")

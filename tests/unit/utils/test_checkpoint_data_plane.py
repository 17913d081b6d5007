"""The trainer-checkpoint hook of `checkpointing.save_data_plane`: the store goes into step_N/data_plane/ and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.data_plane.memory import ColumnarStore, MemoryDataPlaneClient
from relayrl.utils.checkpoint import DATA_PLANE_DIR, data_plane_client_of, load_data_plane, save_data_plane


class _Policy:
    def __init__(self, client: MemoryDataPlaneClient) -> None:
        self.dp_client = client


class _Pair:
    def __init__(self, policy: _Policy) -> None:
        self.policy = policy


def test_store_saved_into_the_step_and_restored(tmp_path: Path) -> None:
    src = MemoryDataPlaneClient(ColumnarStore())
    src.register_partition("val", ["reward"], 2, ["t"])
    src.put_samples(["a", "b"], "val", {"reward": torch.tensor([1.0, 2.0])})
    save_data_plane(data_plane_client_of(_Pair(_Policy(src))), tmp_path, 7)
    assert (tmp_path / DATA_PLANE_DIR / "manifest.json").is_file()
    dst = MemoryDataPlaneClient(ColumnarStore())
    assert load_data_plane(data_plane_client_of(_Policy(dst)), tmp_path)
    assert dst.list_sample_ids("val") == ["a", "b"]
    assert dst.get_samples(["b"], "val", ["reward"])["reward"].values.tolist() == [2.0]
    assert not load_data_plane(dst, tmp_path / "elsewhere")  # a checkpoint saved without the store


def test_trainer_without_a_data_plane_is_refused() -> None:
    with pytest.raises(ValueError, match="save_data_plane=true, but this trainer holds no data plane client"):
        data_plane_client_of(object())

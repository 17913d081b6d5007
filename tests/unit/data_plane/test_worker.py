"""Worker mixin: each rank fetches exactly its keys at the global width; only the replica leader writes back."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.memory import build_client
from relayrl.data_plane.preshard import shard_meta_for_dp
from relayrl.data_plane.schema import GLOBAL_FORWARD_PAD_SEQLEN
from relayrl.data_plane.worker import DataPlaneWorkerMixin

CFG = DataPlaneConfig(enabled=True, backend="memory", storage_capacity=100)


class Worker(DataPlaneWorkerMixin):
    def __init__(self, coords: dict[str, int] | None = None, pad_id: int | None = None):
        self.coords = coords
        self.tokenizer = SimpleNamespace(pad_token_id=pad_id)

    def _local_coords(self) -> dict[str, int]:
        return super()._local_coords() if self.coords is None else self.coords


@pytest.fixture
def seeded() -> Iterator[tuple[object, KVBatchMeta]]:
    driver = build_client(CFG, bootstrap=True)
    driver.register_partition("train", ["input_ids", "token_mask", "prev_logprobs", "sample_mask"], 6, ["train"])
    lens = [3, 6, 2, 5, 4, 1]
    ids = Column.from_rows([torch.arange(100 * i, 100 * i + n) for i, n in enumerate(lens)])
    keys = [f"u{i}_g0" for i in range(6)]
    driver.put_samples(
        keys, "train", {"input_ids": ids, "token_mask": Column(torch.ones(21, dtype=torch.bool), ids.lengths)}
    )
    meta = KVBatchMeta("train", keys, ["input_ids", "token_mask"], lens, extra_info={GLOBAL_FORWARD_PAD_SEQLEN: 8})
    yield driver, meta
    driver.close()


def test_each_rank_fetches_its_keys_at_the_global_width(seeded: tuple[object, KVBatchMeta]) -> None:
    _, meta = seeded
    shards = shard_meta_for_dp(meta, 3)
    for shard in shards:
        w = Worker(pad_id=-7)
        w.setup_data_plane(CFG)
        w.setup_data_plane(CFG)  # idempotent
        data = w._fetch(shard)
        assert data["input_ids"].shape == (2, 8) and data["token_mask"].shape == (2, 8)
        for j, key in enumerate(shard.keys):
            i = int(key[1])
            n = (shard.sequence_lengths or [])[j]
            assert data["input_ids"][j, :n].tolist() == list(range(100 * i, 100 * i + n))
            assert data["input_ids"][j, n:].tolist() == [-7] * (8 - n)
            assert int(data["token_mask"][j].sum()) == n


def test_leader_writes_back_unpadded_and_followers_do_not(seeded: tuple[object, KVBatchMeta]) -> None:
    driver, meta = seeded
    shard = shard_meta_for_dp(meta, 2)[1]  # keys u3, u4, u5 with lengths 5, 4, 1
    leader, follower = Worker({"tensor_parallel": 0}), Worker({"tensor_parallel": 1})
    for w in (leader, follower):
        w.setup_data_plane(CFG)
    padded = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)  # at the global width 8
    assert follower._write_back_result_field(shard, "prev_logprobs", torch.full((3, 8), 99.0)) is False
    assert leader._write_back_result_field(shard, "prev_logprobs", padded) is True
    stored = driver.get_samples(shard.keys, "train", ["prev_logprobs"])["prev_logprobs"]  # type: ignore[attr-defined]
    assert stored.lengths.tolist() == [5, 4, 1]
    assert stored.values.tolist() == padded[0, :5].tolist() + padded[1, :4].tolist() + padded[2, :1].tolist()
    leader._write_back_result_field(shard, "sample_mask", torch.tensor([1.0, 0.0, 1.0]))
    assert driver.get_samples(shard.keys, "train", ["sample_mask"])["sample_mask"].values.tolist() == [1.0, 0.0, 1.0]  # type: ignore[attr-defined]


def test_write_back_rejects_bad_results(seeded: tuple[object, KVBatchMeta]) -> None:
    _, meta = seeded
    w = Worker({})
    with pytest.raises(RuntimeError, match="setup_data_plane"):
        w._write_back_result_field(meta, "prev_logprobs", torch.zeros(6, 8))
    w.setup_data_plane(CFG)
    with pytest.raises(ValueError, match="shape mismatch"):
        w._write_back_result_field(meta, "prev_logprobs", torch.zeros(5, 8))
    with pytest.raises(TypeError, match="torch.Tensor"):
        w._write_back_result_field(meta, "prev_logprobs", [0.0] * 6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sequence_lengths"):
        w._write_back_result_field(KVBatchMeta("train", meta.keys), "prev_logprobs", torch.zeros(6, 8))


def test_single_process_worker_is_leader_and_packing_info_is_passed() -> None:
    w = Worker()
    assert w._local_coords() == {} and w._is_replica_leader()
    meta = KVBatchMeta("p", ["a"], extra_info={"micro_batch_indices": [[[0, 1]]], "other": 1})
    assert w._packing_metadata(meta) == {"micro_batch_indices": [[[0, 1]]]}
    assert Worker(pad_id=None)._pad_value_dict() == {}

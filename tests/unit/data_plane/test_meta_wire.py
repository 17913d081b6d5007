"""KVBatchMeta pickles small and comes back equal (keys, order, lengths, tags and their types)."""

from __future__ import annotations

import pickle
import uuid

import pytest
import torch

from relayrl.data_plane.interfaces import KVBatchMeta


def _step_meta(prompts: int = 16, g: int = 8) -> KVBatchMeta:
    uids = [uuid.uuid4().hex for _ in range(prompts)]
    keys = [f"{uid}_g{i}" for uid in uids for i in range(g)]
    n = len(keys)
    return KVBatchMeta(
        "train",
        keys,
        fields=["input_ids", "token_mask"],
        sequence_lengths=[20 + i % 7 for i in range(n)],
        tags=[
            {"std": s, "baseline": b, "n": i}
            for i, (s, b) in enumerate(zip(torch.rand(n).tolist(), torch.randn(n).tolist()))  # float32 values
        ],
        extra_info={"global_forward_pad_seqlen": 32},
        task_name="train",
    )


def _round_trip(meta: KVBatchMeta) -> KVBatchMeta:
    return pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))


def test_round_trip_is_equal_and_types_are_kept() -> None:
    meta = _step_meta()
    back = _round_trip(meta)
    assert back == meta
    assert all(type(t["n"]) is int and type(t["std"]) is float for t in back.tags or [])


def test_step_handle_is_several_times_smaller_than_a_plain_pickle() -> None:
    meta = _step_meta()
    plain = pickle.dumps(
        (meta.partition_id, meta.keys, meta.fields, meta.sequence_lengths, meta.tags, meta.extra_info, meta.task_name)
    )
    assert len(pickle.dumps(meta)) < len(plain) / 2.5  # the step handle: ~9 KB -> ~2.6 KB on the shipped task


@pytest.mark.parametrize(
    "keys",
    [
        ["a_g1", "b_g01"],  # leading zero: cannot be rebuilt from an int
        ["plain", "x_g0"],  # not uid_gN
        ["a_g1_g2", "a_g1_g3"],  # uid containing _g
        [],
    ],
)
def test_unusual_keys_round_trip(keys: list[str]) -> None:
    meta = KVBatchMeta("p", keys, sequence_lengths=[5] * len(keys), tags=[{"s": "text"}] * len(keys))
    assert _round_trip(meta) == meta


def test_ragged_tags_and_large_values_fall_back_exactly() -> None:
    tags = [{"a": 1.0}, {"a": 2.0, "b": 3}, {}]
    meta = KVBatchMeta("p", ["k_g0", "k_g1", "k_g2"], sequence_lengths=[1, 2**20, 3], tags=tags)
    assert _round_trip(meta) == meta
    mixed = KVBatchMeta("p", ["a_g0", "a_g1"], tags=[{"x": 1.0}, {"x": 1}])  # float and int in one column
    back = _round_trip(mixed)
    assert back == mixed and type((back.tags or [])[1]["x"]) is int
    precise = KVBatchMeta("p", ["a_g0"], tags=[{"x": 0.1}])  # not exact in float32: kept as float64
    assert (_round_trip(precise).tags or [])[0]["x"] == 0.1

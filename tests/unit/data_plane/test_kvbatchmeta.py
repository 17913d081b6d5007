"""KVBatchMeta: construction rules and the pure metadata transforms (keys, lengths and tags in lockstep)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from relayrl.data_plane.interfaces import KVBatchMeta


def _meta(n: int = 4, partition: str = "train") -> KVBatchMeta:
    return KVBatchMeta(
        partition,
        [f"k{i}" for i in range(n)],
        fields=["input_ids"],
        sequence_lengths=[10 + i for i in range(n)],
        tags=[{"i": i} for i in range(n)],
        extra_info={"step": 5},
        task_name="train",
    )


def test_field_set_and_order_are_pinned() -> None:
    names = [f.name for f in dataclasses.fields(KVBatchMeta)]
    assert names == ["partition_id", "keys", "fields", "sequence_lengths", "tags", "extra_info", "task_name"]


def test_defaults_size_and_independent_extra_info() -> None:
    a, b = KVBatchMeta("p", ["a", "b", "c"]), KVBatchMeta("p", [])
    assert a.size == 3 and b.size == 0
    assert a.fields is None and a.sequence_lengths is None and a.tags is None and a.extra_info == {}
    a.extra_info["x"] = 1
    assert b.extra_info == {}
    assert KVBatchMeta("p", ["a", "a"]).size == 2
    with pytest.raises(TypeError):
        KVBatchMeta(keys=["a"])  # type: ignore[call-arg]


def test_pickle_round_trip() -> None:
    m = _meta()
    back = pickle.loads(pickle.dumps(m))
    assert back == m and back.size == 4
    assert pickle.loads(pickle.dumps(KVBatchMeta("p", []))).size == 0


def test_misaligned_tags_and_lengths_raise() -> None:
    with pytest.raises(ValueError, match="align 1:1"):
        KVBatchMeta("p", ["a", "b"], tags=[{}])
    with pytest.raises(ValueError, match="align 1:1"):
        KVBatchMeta("p", ["a", "b"], sequence_lengths=[1, 2, 3])


def test_stamp_tags_in_place() -> None:
    m = KVBatchMeta("p", ["a", "b"])
    m.stamp_tags({"std": [0.5, 0.0], "total_reward": [1.0, 0.0]})
    assert m.tags == [{"std": 0.5, "total_reward": 1.0}, {"std": 0.0, "total_reward": 0.0}]
    with pytest.raises(ValueError, match="'baseline' has 3 values, expected 2"):
        m.stamp_tags({"baseline": [1, 2, 3]})
    assert "baseline" not in (m.tags or [{}])[0]


def test_subset_slice_concat_keep_lockstep() -> None:
    m = _meta(6)
    s = m.subset([5, 1, 3])
    assert s.keys == ["k5", "k1", "k3"] and s.sequence_lengths == [15, 11, 13]
    assert s.tags == [{"i": 5}, {"i": 1}, {"i": 3}] and s.partition_id == "train" and s.extra_info == {"step": 5}
    assert s.extra_info is not m.extra_info
    sl = m.slice(1, 4)
    assert sl.keys == ["k1", "k2", "k3"] and sl.sequence_lengths == [11, 12, 13]
    assert m.slice(4, 100).keys == ["k4", "k5"]
    back = m.slice(0, 3).concat(m.subset([3, 4, 5]))
    assert back.keys == m.keys and back.sequence_lengths == m.sequence_lengths and back.tags == m.tags


def test_concat_rules() -> None:
    m = _meta(2)
    no_tags = KVBatchMeta("train", ["x"], sequence_lengths=[7])
    joined = m.concat(no_tags)
    assert joined.keys == ["k0", "k1", "x"] and joined.tags is None and joined.sequence_lengths == [10, 11, 7]
    assert m.concat(KVBatchMeta("train", ["y"])).sequence_lengths is None
    with pytest.raises(ValueError, match="partition_ids must match"):
        m.concat(KVBatchMeta("val", ["z"]))


def test_drop() -> None:
    m = _meta(4)
    d = m.drop([1, 3])
    assert (
        d is not None and d.keys == ["k0", "k2"] and d.sequence_lengths == [10, 12] and d.tags == [{"i": 0}, {"i": 2}]
    )
    same = m.drop([])
    assert same is not None and same is not m and same.keys == m.keys
    assert m.drop(range(4)) is None
    three = _meta(3).drop([2, 0, 0])
    assert three is not None and three.keys == ["k1"]


def test_with_fields_dedups_and_is_independent() -> None:
    m = KVBatchMeta("p", ["a"], fields=["input_ids", "advantages"], sequence_lengths=[3], tags=[{"s": 1}])
    w = m.with_fields(["advantages", "logprobs"])
    assert w.fields == ["input_ids", "advantages", "logprobs"]
    assert KVBatchMeta("p", []).with_fields(["x", "y", "x"]).fields == ["x", "y"]
    w.keys.append("b")
    (w.tags or [{}])[0]["s"] = 99
    (w.sequence_lengths or []).append(4)
    assert (
        m.keys == ["a"]
        and m.tags == [{"s": 1}]
        and m.sequence_lengths == [3]
        and m.fields == ["input_ids", "advantages"]
    )

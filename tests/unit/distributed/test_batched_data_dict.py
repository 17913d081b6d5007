from __future__ import annotations

import pytest
import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict


def _bdd(n: int = 4) -> BatchedDataDict:
    return BatchedDataDict(
        {
            "ids": torch.arange(n * 3).reshape(n, 3),
            "reward": torch.arange(n, dtype=torch.float32),
            "text": [f"t{i}" for i in range(n)],
            "meta": [{"i": i} for i in range(n)],
            "scalar": torch.tensor(7.0),  # 0-d values ride along untouched
            "note": "shared",
        }
    )


# ---------------------------------------------------------------------------------------------------- shape
def test_size_and_consistency() -> None:
    assert _bdd(5).size == 5
    assert BatchedDataDict().size == 0
    assert BatchedDataDict({"x": torch.tensor(1.0), "y": "z"}).size == 0


def test_mismatched_lengths_name_the_keys() -> None:
    b = BatchedDataDict({"input_ids": torch.zeros(4, 2), "rewards": torch.zeros(3), "text": ["a"] * 4})
    with pytest.raises(ValueError, match=r"input_ids=4.*rewards=3"):
        _ = b.size
    with pytest.raises(ValueError, match="rewards=3"):
        b.check_consistent()
    with pytest.raises(ValueError, match="rewards"):
        list(b.make_microbatch_iterator(2))


# ---------------------------------------------------------------------------------------------------- selection
def test_repeat_interleave_is_contiguous_and_deep_copies_lists() -> None:
    b = _bdd(2)
    r = b.repeat_interleave(3)
    assert r["reward"].tolist() == [0, 0, 0, 1, 1, 1]
    assert r["ids"].tolist() == [[0, 1, 2]] * 3 + [[3, 4, 5]] * 3
    assert r["text"] == ["t0", "t0", "t0", "t1", "t1", "t1"]
    assert r["scalar"] is b["scalar"] and r["note"] == "shared"
    r["meta"][0]["i"] = 99  # copies diverge independently of each other and of the source
    assert [m["i"] for m in r["meta"]] == [99, 0, 0, 1, 1, 1]
    assert b["meta"][0] == {"i": 0}
    assert isinstance(r, BatchedDataDict) and r.size == 6


def test_repeat_interleave_copies_message_logs_like_deepcopy() -> None:
    class Custom:  # anything but plain dicts / lists / tensors / scalars still goes through copy.deepcopy
        def __init__(self) -> None:
            self.items = [1]

    msg = {"role": "user", "token_ids": torch.tensor([1, 2, 3]), "flags": {"x": [1]}, "obj": Custom(), "n": None}
    b = BatchedDataDict({"message_log": [[msg]], "w": [torch.ones(2, requires_grad=True)]})
    r = b.repeat_interleave(2)
    first, second = r["message_log"][0][0], r["message_log"][1][0]
    first["token_ids"][0] = 99  # tensors are copies: no row (nor the source) sees another's in-place edit
    first["flags"]["x"].append(2)
    first["obj"].items.append(2)
    assert second["token_ids"].tolist() == [1, 2, 3] and msg["token_ids"].tolist() == [1, 2, 3]
    assert second["flags"] == {"x": [1]} and msg["flags"] == {"x": [1]}
    assert second["obj"].items == [1] and msg["obj"].items == [1] and first["n"] is None
    assert r["w"][0].requires_grad and r["w"][0] is not b["w"][0] and r["w"][0] is not r["w"][1]


def test_select_indices_orders_and_repeats() -> None:
    b = _bdd(4)
    s = b.select_indices([3, 1, 1])
    assert s["reward"].tolist() == [3, 1, 1]
    assert s["ids"][0].tolist() == [9, 10, 11]
    assert s["text"] == ["t3", "t1", "t1"]
    assert s["note"] == "shared" and s.size == 3
    assert b.select_indices(torch.tensor([2]))["text"] == ["t2"]
    assert b.select_indices([]).size == 0


def test_select_indices_with_bool_mask_selects_rows() -> None:
    b = _bdd(4)
    out = b.select_indices(torch.tensor([True, False, True, False]))
    assert out["reward"].tolist() == [0, 2]
    assert out["text"] == ["t0", "t2"]
    with pytest.raises(ValueError, match="bool row mask"):
        b.select_indices(torch.tensor([True, False]))
    with pytest.raises(IndexError, match="row indices"):
        b.select_indices([-1])


def test_select_keys_shares_values_and_names_missing() -> None:
    b = _bdd(3)
    s = b.select_keys(["reward", "text"])
    assert isinstance(s, BatchedDataDict) and list(s) == ["reward", "text"]
    assert s["reward"] is b["reward"] and s.size == 3
    with pytest.raises(KeyError, match="nope"):
        b.select_keys(["reward", "nope"])


def test_slice_and_get_batch() -> None:
    b = _bdd(6)
    s = b.slice(1, 4)
    assert s["reward"].tolist() == [1, 2, 3] and s["text"] == ["t1", "t2", "t3"]
    assert s["scalar"].item() == 7.0
    s["reward"][0] = -1  # tensor slices are views
    assert b["reward"][1].item() == -1
    s["text"][0] = "changed"  # list slices are shallow copies
    assert b["text"][1] == "t1"
    assert b.get_batch(2, 2)["text"] == ["t4", "t5"]
    assert b.slice(5, 10).size == 1


def test_copy_keeps_type_and_is_shallow() -> None:
    b = _bdd(2)
    c = b.copy()
    assert isinstance(c, BatchedDataDict)
    c["extra"] = [1, 2]
    assert "extra" not in b
    assert c["reward"] is b["reward"]
    assert b.get_dict() == dict(b) and type(b.get_dict()) is dict


# ---------------------------------------------------------------------------------------------------- sharding
PROBLEMS = [0, 0, 1, 1, 2, 2, 3, 3]


def _problems() -> BatchedDataDict:
    return BatchedDataDict({"problem_id": torch.tensor(PROBLEMS), "tag": [f"p{p}" for p in PROBLEMS]})


def test_shard_contiguous() -> None:
    shards = _problems().shard_by_batch_size(2)
    assert [s["problem_id"].tolist() for s in shards] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert shards[1]["tag"] == ["p2", "p2", "p3", "p3"]


def test_shard_with_batch_size_interleaves_global_batches() -> None:
    shards = _problems().shard_by_batch_size(2, batch_size=4)
    assert [s["problem_id"].tolist() for s in shards] == [[0, 0, 2, 2], [1, 1, 3, 3]]
    assert shards[0]["tag"] == ["p0", "p0", "p2", "p2"]


def test_shard_uneven() -> None:
    b = BatchedDataDict({"x": torch.arange(5)})
    with pytest.raises(ValueError, match="evenly"):
        b.shard_by_batch_size(2)
    shards = b.shard_by_batch_size(2, allow_uneven_shards=True)
    assert [s["x"].tolist() for s in shards] == [[0, 1, 2], [3, 4]]


def test_shard_errors() -> None:
    b = _problems()
    with pytest.raises(ValueError, match="multiple of the global batch size 3"):
        b.shard_by_batch_size(1, batch_size=3)
    with pytest.raises(ValueError, match="does not split evenly into 3 shards"):
        b.shard_by_batch_size(3, batch_size=4)
    with pytest.raises(ValueError, match="shards must be >= 1"):
        b.shard_by_batch_size(0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        b.shard_by_batch_size(2, batch_size=0)


def test_reorder_data_inverts_sharding_permutation() -> None:
    b = BatchedDataDict({"x": torch.arange(8) * 10, "s": [str(i) for i in range(8)]})
    shards = b.shard_by_batch_size(2, batch_size=4)
    merged = BatchedDataDict.from_batches(shards)
    perm = [0, 1, 4, 5, 2, 3, 6, 7]  # original row of each merged row
    assert merged["x"].tolist() == [10 * p for p in perm]
    restored = merged.reorder_data(perm)
    assert restored["x"].tolist() == b["x"].tolist() and restored["s"] == b["s"]
    # a random permutation round-trips too
    g = torch.Generator().manual_seed(0)
    rand_perm = torch.randperm(8, generator=g)
    assert b.select_indices(rand_perm).reorder_data(rand_perm)["s"] == b["s"]


# ---------------------------------------------------------------------------------------------------- micro-batches
def test_microbatch_iterator() -> None:
    b = _bdd(6)
    mbs = list(b.make_microbatch_iterator(2))
    assert [m["reward"].tolist() for m in mbs] == [[0, 1], [2, 3], [4, 5]]
    assert [m["text"] for m in mbs][2] == ["t4", "t5"]
    assert all(m["note"] == "shared" for m in mbs)
    assert len(list(b.make_microbatch_iterator(6))) == 1
    with pytest.raises(ValueError, match="micro-batches of 4"):
        list(b.make_microbatch_iterator(4))
    with pytest.raises(ValueError, match=">= 1"):
        list(b.make_microbatch_iterator(0))


# ---------------------------------------------------------------------------------------------------- assembly
def test_from_batches_pads_and_concatenates() -> None:
    a = {
        "input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]]),
        "mask": torch.ones(2, 3, dtype=torch.bool),
        "lengths": torch.tensor([3, 3]),
        "logits": torch.ones(2, 3, 2),
        "text": ["a", "b"],
        "scalar": torch.tensor(1.0),
        "note": "first",
    }
    b = {
        "input_ids": torch.tensor([[7, 8, 9, 10, 11]]),
        "mask": torch.ones(1, 5, dtype=torch.bool),
        "lengths": torch.tensor([5]),
        "logits": torch.full((1, 5, 2), 2.0),
        "text": ["c"],
        "scalar": torch.tensor(2.0),
        "note": "second",
    }
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"input_ids": -100})
    assert isinstance(out, BatchedDataDict) and out.size == 3
    assert out["input_ids"].tolist() == [[1, 2, 3, -100, -100], [4, 5, 6, -100, -100], [7, 8, 9, 10, 11]]
    assert out["mask"].tolist()[0] == [True, True, True, False, False] and out["mask"].dtype == torch.bool
    assert out["lengths"].tolist() == [3, 3, 5]
    assert out["logits"].shape == (3, 5, 2)
    assert out["logits"][0, 3:].abs().sum().item() == 0 and out["logits"][2].min().item() == 2.0
    assert out["text"] == ["a", "b", "c"]
    assert out["scalar"].item() == 1.0 and out["note"] == "first"
    assert BatchedDataDict.from_batches([]) == {}


def test_to_device_moves_tensors_in_place() -> None:
    b = _bdd(2)
    out = b.to("meta")
    assert out is b
    assert b["ids"].device.type == "meta" and b["scalar"].device.type == "meta"
    assert b["text"] == ["t0", "t1"] and b["note"] == "shared"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_and_select_on_device() -> None:
    b = _bdd(4).to("cuda")
    s = b.select_indices([2, 0])
    assert s["reward"].device.type == "cuda" and s["reward"].tolist() == [2, 0]
    assert s.to("cpu")["ids"].device.type == "cpu"

"""shard_meta_for_dp: the reference worked examples, uneven splits, propagation of extra_info and tags."""

from __future__ import annotations

import pytest

from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.preshard import dp_shard_rows, inverse_permutation, pack_bins, shard_meta_for_dp

L = [1204, 499, 1445, 876, 361, 487, 927, 678]
SP = {"algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": 64, "input_key": "input_ids"}


def _meta(n: int = 8) -> KVBatchMeta:
    return KVBatchMeta(
        "train",
        [f"k{i}" for i in range(n)],
        fields=["input_ids"],
        sequence_lengths=(L * 4)[:n],
        tags=[{"i": i} for i in range(n)],
        extra_info={"global_forward_pad_seqlen": 1472, "rollout_metrics": {"x": 1}},
        task_name="train",
    )


def _ids(shards: list[KVBatchMeta]) -> list[list[str]]:
    return [s.keys for s in shards]


def _unsorted(dp: int, **kw: object) -> list[int] | None:
    return inverse_permutation(dp_shard_rows(L, 8, dp, **kw)[0])  # type: ignore[arg-type]


def test_no_packing() -> None:
    assert _ids(shard_meta_for_dp(_meta(), 4)) == [["k0", "k1"], ["k2", "k3"], ["k4", "k5"], ["k6", "k7"]]
    assert _unsorted(4) is None
    two = shard_meta_for_dp(_meta(), 2, batch_size=4)
    assert _ids(two) == [["k0", "k1", "k4", "k5"], ["k2", "k3", "k6", "k7"]]
    assert _unsorted(2, batch_size=4) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert _ids(shard_meta_for_dp(_meta(), 1)) == [_meta().keys]


def test_dynamic_batching_examples() -> None:
    args = {"sequence_length_round": 64, "max_tokens_per_microbatch": 4096}
    shards = shard_meta_for_dp(_meta(), 4, dynamic_batching_args=args)
    assert _ids(shards) == [["k4", "k3"], ["k5", "k6"], ["k1", "k0"], ["k7", "k2"]]
    assert all(s.extra_info["micro_batch_indices"] == [[[0, 2]]] for s in shards)
    assert all(s.extra_info["micro_batch_lengths"] == [[1472]] for s in shards)
    assert _unsorted(4, dynamic_batching_args=args) == [5, 4, 7, 1, 0, 2, 3, 6]
    args2 = {"sequence_length_round": 64, "max_tokens_per_microbatch": 2048}
    shards = shard_meta_for_dp(_meta(), 2, dynamic_batching_args=args2)
    assert _ids(shards) == [["k4", "k1", "k3", "k0"], ["k5", "k7", "k6", "k2"]]
    assert shards[1].extra_info["micro_batch_indices"] == [[[0, 2], [2, 3], [3, 4]]]
    assert shards[1].extra_info["micro_batch_lengths"] == [[704, 960, 1472]]
    assert _unsorted(2, dynamic_batching_args=args2) == [3, 1, 7, 2, 0, 4, 6, 5]


def test_sequence_packing_worked_examples() -> None:
    shards = shard_meta_for_dp(_meta(), 4, sequence_packing_args={**SP, "max_tokens_per_microbatch": 4096})
    assert _ids(shards) == [["k3", "k7", "k1"], ["k2", "k0", "k6"], ["k4"], ["k5"]]
    info = [
        (s.extra_info["micro_batch_indices"], s.extra_info["micro_batch_lengths"], s.extra_info["elem_counts_per_gb"])
        for s in shards
    ]
    assert info == [
        ([[[0, 3]]], [[2112]], [3]),
        ([[[0, 3]]], [[3648]], [3]),
        ([[[0, 1]]], [[384]], [1]),
        ([[[0, 1]]], [[512]], [1]),
    ]
    assert _unsorted(4, sequence_packing_args={**SP, "max_tokens_per_microbatch": 4096}) == [4, 2, 3, 0, 6, 7, 5, 1]
    two = shard_meta_for_dp(_meta(), 2, sequence_packing_args={**SP, "max_tokens_per_microbatch": 2048})
    assert _ids(two) == [["k2", "k1", "k5", "k4"], ["k0", "k7", "k6", "k3"]]
    assert two[0].extra_info["micro_batch_lengths"] == [[1984, 896]]
    assert two[1].extra_info["micro_batch_lengths"] == [[1920, 1856]]
    assert two[1].extra_info["micro_batch_indices"] == [[[0, 2], [2, 4]]]


def test_largest_first_orders_bins_by_tokens() -> None:
    sp = {**SP, "max_tokens_per_microbatch": 2048, "microbatch_order": "largest_first"}
    two = shard_meta_for_dp(_meta(), 1, sequence_packing_args=sp)[0]
    assert two.extra_info["micro_batch_lengths"][0] == sorted(two.extra_info["micro_batch_lengths"][0], reverse=True)


def test_extra_info_tags_and_lengths_reach_every_shard() -> None:
    m = _meta()
    shards = shard_meta_for_dp(
        m, 4, dynamic_batching_args={"sequence_length_round": 64, "max_tokens_per_microbatch": 4096}
    )
    for s in shards:
        assert s.extra_info["global_forward_pad_seqlen"] == 1472 and s.extra_info["rollout_metrics"] == {"x": 1}
        assert s.partition_id == "train" and s.task_name == "train" and s.fields == ["input_ids"]
        assert [int(k[1:]) for k in s.keys] == [t["i"] for t in s.tags or []]
        assert s.sequence_lengths == [L[int(k[1:])] for k in s.keys]
    assert "micro_batch_indices" not in m.extra_info
    assert sorted(k for s in shards for k in s.keys) == sorted(m.keys)


@pytest.mark.parametrize("n,dp,bs", [(8, 3, None), (10, 4, None), (12, 5, 6), (3, 4, None), (9, 2, 3)])
def test_uneven_splits_differ_by_at_most_one_row(n: int, dp: int, bs: int | None) -> None:
    m = _meta(n)
    for kw in ({}, {"dynamic_batching_args": {"sequence_length_round": 64, "max_tokens_per_microbatch": 4096}}):
        shards = shard_meta_for_dp(m, dp, batch_size=bs, **kw)  # type: ignore[arg-type]
        sizes = [s.size for s in shards]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
        assert sorted(k for s in shards for k in s.keys) == sorted(m.keys)
        if kw:  # every rank runs the same number of micro-batches per global batch
            assert len({len(s.extra_info["micro_batch_indices"][0]) for s in shards}) == 1


def test_sequence_packing_with_fewer_rows_than_ranks_gives_empty_bins() -> None:
    shards = shard_meta_for_dp(_meta(3), 4, sequence_packing_args={**SP, "max_tokens_per_microbatch": 4096})
    assert sorted(s.size for s in shards) == [0, 1, 1, 1]
    assert all(len(s.extra_info["micro_batch_indices"][0]) == 1 for s in shards)


def test_errors() -> None:
    with pytest.raises(ValueError, match="empty meta"):
        shard_meta_for_dp(KVBatchMeta("p", []), 2)
    with pytest.raises(ValueError, match="sequence_lengths"):
        shard_meta_for_dp(
            KVBatchMeta("p", ["a"]),
            1,
            dynamic_batching_args={"sequence_length_round": 1, "max_tokens_per_microbatch": 8},
        )
    with pytest.raises(ValueError, match="at most one"):
        shard_meta_for_dp(_meta(), 2, sequence_packing_args=SP, dynamic_batching_args={})
    with pytest.raises(ValueError, match=r"Total batch size \(8\) is not a multiple of batch_size \(3\)"):
        shard_meta_for_dp(_meta(), 2, batch_size=3)
    with pytest.raises(ValueError, match="Sequence length 1216 exceeds bin capacity 1024"):
        shard_meta_for_dp(_meta(), 2, sequence_packing_args={**SP, "max_tokens_per_microbatch": 1024})
    with pytest.raises(ValueError, match="exceeds max_tokens_per_microbatch=1024"):
        shard_meta_for_dp(
            _meta(), 2, dynamic_batching_args={"sequence_length_round": 64, "max_tokens_per_microbatch": 1024}
        )
    with pytest.raises(ValueError, match="unknown keys"):
        shard_meta_for_dp(
            _meta(),
            2,
            dynamic_batching_args={"sequence_length_round": 64, "max_tokens_per_microbatch": 4096, "oops": 1},
        )
    with pytest.raises(ValueError, match="microbatch_order"):
        shard_meta_for_dp(
            _meta(), 2, sequence_packing_args={**SP, "max_tokens_per_microbatch": 4096, "microbatch_order": "x"}
        )


@pytest.mark.parametrize(
    "algorithm", ["concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing"]
)
def test_every_packer_respects_capacity_and_bin_counts(algorithm: str) -> None:
    sizes = [64 * (1 + (i * 7) % 23) for i in range(40)]
    bins = pack_bins(sizes, 2048, algorithm, min_bins=4, multiple=4)
    assert len(bins) % 4 == 0 and sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(sizes[i] for i in b) <= 2048 for b in bins)

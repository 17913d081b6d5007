"""Sequence packing and dynamic batching, planning side: config keys, planner arguments, per-rank plans, micro-batch
cutting and the replays that keep data-parallel ranks in step (relayrl/models/microbatch.py)."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ValidationError

from relayrl.config import (
    DynamicBatchingConfig,
    MasterConfig,
    PolicyConfig,
    SequencePackingConfig,
    ValueConfig,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.microbatch import (
    MicroBatch,
    PlannedBatch,
    ShardPlan,
    cut,
    deal_bins,
    local_plan,
    mb_tokens,
    packing_args,
    pass_batches,
    place,
    plan_of,
    plan_rows,
    plan_shards,
    with_replays,
)
from relayrl.utils.config_io import ConfigError, load_config

SP_ARGS = {
    "algorithm": "modified_first_fit_decreasing",
    "sequence_length_pad_multiple": 1,
    "max_tokens_per_microbatch": 1024,
    "microbatch_order": "packer",
}
SKEWED = [700, 3, 41, 12, 380, 5, 256, 90, 17, 511, 2, 64]  # lengths of a skewed batch (12 rows)


def batch(lengths: list[int], width: int | None = None) -> BatchedDataDict:
    n, seq = len(lengths), width or max(lengths)
    lens = torch.tensor(lengths)
    real = torch.arange(seq)[None, :] < lens[:, None]  # [B, S]
    return BatchedDataDict(
        input_ids=torch.arange(n * seq).view(n, seq).masked_fill(~real, 0),  # [B, S] distinct per row
        input_lengths=lens,  # [B]
        token_mask=real.float(),  # [B, S]
        sample_mask=torch.ones(n),  # [B]
        row=torch.arange(n),  # [B] which input row
    )


def policy(**keys: Any) -> PolicyConfig:
    base: dict[str, Any] = dict(train_micro_batch_size=4, max_total_sequence_length=704, train_global_batch_size=12)
    return PolicyConfig.model_validate({**base, **keys})


# ---------------------------------------------------------------------------------------------------- config
def test_defaults_are_off_and_every_new_field_is_documented() -> None:
    for cfg in (PolicyConfig(), ValueConfig()):
        assert not cfg.sequence_packing.enabled and not cfg.dynamic_batching.enabled
        assert packing_args(cfg, "train_mb_tokens") == (None, None) == packing_args(cfg, "logprob_mb_tokens")
    assert SequencePackingConfig().algorithm == "modified_first_fit_decreasing"
    assert SequencePackingConfig().microbatch_order == "packer"
    assert DynamicBatchingConfig().sequence_length_round == 64
    models: list[type[BaseModel]] = [SequencePackingConfig, DynamicBatchingConfig]
    for model in models:
        assert model.__doc__
        source = inspect.getsource(model)
        for name in model.model_fields:  # a docstring right under every field
            line = next(i for i, s in enumerate(source.splitlines()) if s.strip().startswith(f"{name}:") and i > 0)
            assert source.splitlines()[line + 1].strip().startswith('"""'), f"{model.__name__}.{name}"


@pytest.mark.parametrize("section", ["policy", "value"])
def test_both_modes_together_are_refused_in_one_line_naming_both_keys(section: str) -> None:
    keys = [f"{section}.sequence_packing.enabled=true", f"{section}.dynamic_batching.enabled=true"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*keys, "algorithm=ppo"] if section == "value" else keys)
    message = str(err.value)
    assert "\n" not in message
    assert f"{section}.sequence_packing.enabled" in message and f"{section}.dynamic_batching.enabled" in message
    with pytest.raises(ValidationError, match="mutually exclusive"):
        PolicyConfig(sequence_packing={"enabled": True}, dynamic_batching={"enabled": True})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="algorithm"):
        SequencePackingConfig(algorithm="best_fit")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=f"{section}.sequence_packing.train_mb_tokens = 32 is below"):
        load_config(
            None,
            [
                "algorithm=ppo",
                f"{section}.sequence_packing.enabled=true",
                f"{section}.sequence_packing.train_mb_tokens=32",
            ],
        )
    with pytest.raises(ValidationError, match="rounded to dynamic_batching.sequence_length_round: 128"):
        policy(dynamic_batching={"enabled": True, "logprob_mb_tokens": 100}, max_total_sequence_length=65)
    assert MasterConfig.model_validate(
        {"value": {"sequence_packing": {"enabled": True}}}
    ).value.sequence_packing.enabled


def test_packing_args_follow_the_config_and_are_fresh_copies() -> None:
    sp = policy(sequence_packing={"enabled": True, "logprob_mb_tokens": 900, "microbatch_order": "largest_first"})
    args, none = packing_args(sp, "logprob_mb_tokens")
    assert none is None and args == {
        "algorithm": "modified_first_fit_decreasing",
        "sequence_length_pad_multiple": 1,
        "max_tokens_per_microbatch": 900,
        "microbatch_order": "largest_first",
    }
    assert packing_args(sp, "train_mb_tokens")[0]["max_tokens_per_microbatch"] == 704 * 4  # type: ignore[index]
    args["max_tokens_per_microbatch"] = 1  # type: ignore[index]
    assert packing_args(sp, "logprob_mb_tokens")[0]["max_tokens_per_microbatch"] == 900  # type: ignore[index]
    db = policy(dynamic_batching={"enabled": True, "sequence_length_round": 8}, logprob_batch_size=2)
    assert packing_args(db, "logprob_mb_tokens") == (
        None,
        {"sequence_length_round": 8, "max_tokens_per_microbatch": 704 * 2},
    )
    assert mb_tokens(db, "train_mb_tokens") == 704 * 4
    with pytest.raises(ValueError, match="unknown stage key"):
        packing_args(db, "mb_tokens")


# ---------------------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_plan_shards_cover_every_row_once_balanced_with_equal_counts(mode: str, dp: int) -> None:
    keys = {"enabled": True, "logprob_mb_tokens": 1024}
    cfg = policy(**({"sequence_packing": keys} if mode == "packing" else {"dynamic_batching": keys}))
    data = batch(SKEWED)
    planned = plan_shards(data, dp, cfg, "logprob_mb_tokens", None)
    assert planned is not None
    shards, unsorted = planned
    rows = torch.cat([s["row"] for s in shards])
    assert sorted(rows.tolist()) == list(range(len(SKEWED)))
    if unsorted is not None:
        assert rows[torch.tensor(unsorted)].tolist() == list(range(len(SKEWED)))  # inverse permutation
    plans = [plan_of(s) for s in shards]
    assert all(p is not None and p.mode == mode for p in plans)
    counts = {len(p.micro_batch_indices[0]) for p in plans if p is not None}
    assert len(counts) == 1  # every rank runs as many micro-batches (no collective left waiting)
    for shard, p in zip(shards, plans):
        assert p is not None and p.gb_bounds() == [(0, shard.size)]
        for mb in p.micro_batches(0):
            lengths = shard["input_lengths"][mb.start : mb.end]
            if mode == "packing":  # a bin never exceeds its token capacity
                assert int(lengths.sum()) <= 1024
            elif mb.end > mb.start:
                assert mb.width is not None and mb.width % 64 == 0 and (mb.end - mb.start) * mb.width <= 1024
    if mode == "packing" and dp > 1:  # balanced token loads: the heaviest bin goes to the lightest rank
        loads = sorted(int(s["input_lengths"].sum()) for s in shards)
        smallest_bin = min(x for p in plans if p is not None for x in p.micro_batch_lengths[0])
        assert loads[-1] - loads[0] <= 1024 - smallest_bin
    assert plan_shards(data, dp, policy(), "logprob_mb_tokens", None) is None  # both off: the façade's own split


def test_train_plans_keep_global_batches_apart() -> None:
    cfg = policy(sequence_packing={"enabled": True, "train_mb_tokens": 1024}, train_global_batch_size=6)
    planned = plan_shards(batch(SKEWED), 2, cfg, "train_mb_tokens", 6)
    assert planned is not None
    for shard in planned[0]:
        p = plan_of(shard)
        assert p is not None and len(p.elem_counts_per_gb) == 2
        for gb, (start, end) in enumerate(p.gb_bounds()):
            assert set(shard["row"][start:end].tolist()) <= set(range(6 * gb, 6 * gb + 6))  # rows stay in their gb


def test_bins_are_dealt_by_token_load_with_equal_counts() -> None:
    assert deal_bins([1023, 981, 41, 36], 2) == [[0, 3], [1, 2]]  # 1059 vs 1022 (round-robin: 1064 vs 1017)
    assert deal_bins([5, 90, 7, 88, 50, 52], 3) == [[0, 1], [2, 3], [4, 5]]  # 95, 95, 102
    loads = [1023, 36, 1022]
    rows, info = plan_rows([700, 256, 64, 3, 17, 12, 5, 2, 511, 380, 90, 41], 3, None, (SP_ARGS, None))
    assert sorted(len(i["micro_batch_indices"][0]) for i in info) == [1, 1, 1]
    assert sorted(i["micro_batch_lengths"][0][0] for i in info) == sorted(loads)
    two, _ = plan_rows([700, 256, 64, 3, 17, 12, 5, 2, 511, 380, 90, 41], 2, None, (SP_ARGS, None))
    totals = [sum([700, 256, 64, 3, 17, 12, 5, 2, 511, 380, 90, 41][i] for i in r) for r in two]
    assert abs(totals[0] - totals[1]) <= 41  # one small bin apart (round-robin: 2004 vs 77)


def test_shard_plan_from_extra_info_and_planned_batches_survive_pickling() -> None:
    info = {"micro_batch_indices": [[[0, 2], [2, 3], [3, 3]]], "micro_batch_lengths": [[64, 128, 128]]}
    plan = ShardPlan.from_info("dynamic", info)
    assert plan is not None and plan.elem_counts_per_gb == [3]
    assert plan.micro_batches(0) == [MicroBatch(0, 2, 64), MicroBatch(2, 3, 128), MicroBatch(3, 3, 128)]
    assert ShardPlan.from_info("packing", {}) is None
    shipped = pickle.loads(pickle.dumps(PlannedBatch.of(batch([3, 1, 2]), plan)))  # what Ray does with a shard
    assert isinstance(shipped, PlannedBatch) and shipped.plan == plan and torch.equal(shipped["row"], torch.arange(3))
    assert plan_of(shipped.slice(0, 1)) is None and plan_of(batch([1])) is None


def test_local_plan_orders_rows_and_maps_them_back() -> None:
    cfg = policy(sequence_packing={"enabled": True, "logprob_mb_tokens": 800})
    ordered, plan, origin = local_plan(batch(SKEWED), cfg, "logprob_mb_tokens", None)
    assert torch.equal(ordered["row"], origin)
    assert plan.elem_counts_per_gb == [len(SKEWED)]
    seen: list[int] = []
    for rows, mb in pass_batches(batch(SKEWED), cfg, 4, torch.device("cpu")):
        assert isinstance(rows, torch.Tensor) and torch.equal(mb["row"], rows)  # original rows of each micro-batch
        assert mb["input_ids"].shape[1] == int(mb["input_lengths"].max())  # a bin is cut to its longest row
        seen += rows.tolist()
    assert sorted(seen) == list(range(len(SKEWED)))


# ---------------------------------------------------------------------------------------------------- cutting
def test_cut_brings_rows_to_the_planned_width_and_never_drops_a_real_token() -> None:
    data = batch([5, 9, 2], width=16)
    narrow = cut(data, MicroBatch(0, 2, 12))
    assert narrow["input_ids"].shape == (2, 12) and narrow["token_mask"].shape == (2, 12)
    assert narrow["sample_mask"].shape == (2,) and torch.equal(narrow["input_ids"], data["input_ids"][:2, :12])
    assert cut(data, MicroBatch(0, 2, 4))["input_ids"].shape == (2, 9)  # the longest row wins over the width
    assert cut(data, MicroBatch(2, 3, None))["input_ids"].shape == (1, 2)  # packing: the bin's longest row
    wide = cut(data, MicroBatch(0, 3, 24))  # the planned width, whatever the batch was padded to
    assert wide["input_ids"].shape == (3, 24) and wide["token_mask"][:, 16:].abs().sum() == 0
    assert torch.equal(wide["input_ids"][:, :16], data["input_ids"])
    out = torch.zeros(3, 16)
    place(out, range(0, 3), wide["token_mask"])  # a result back at the batch's width
    assert torch.equal(out, data["token_mask"])


def test_with_replays_tops_up_with_the_ranks_own_micro_batches() -> None:
    own = [MicroBatch(0, 2, None), MicroBatch(2, 2, None), MicroBatch(2, 5, None)]
    out = with_replays(own, 5)
    assert [(m.start, m.end, m.replay) for m in out] == [
        (0, 2, False),
        (2, 5, False),
        (0, 2, True),
        (2, 5, True),
        (0, 2, True),
    ]
    assert with_replays(own, 1) == [own[0], own[2]]  # never fewer than its own
    with pytest.raises(ValueError, match="without rows"):
        with_replays([MicroBatch(0, 0, None)], 2)

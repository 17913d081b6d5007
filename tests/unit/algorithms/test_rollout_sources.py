"""Rollout sources (issue 25): what `ActorSource` does around one rollout-actor call, in order, and what it hands over."""

from __future__ import annotations

from typing import Any

import torch

from relayrl.algorithms.protocols import Rollout, RolloutSource
from relayrl.algorithms.rollout_sources import ActorSource, RolloutSpec, received
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.carry_wire import encode_carry, wire_nbytes
from relayrl.utils.timer import Timer

G = 2


class _Events:
    def __init__(self) -> None:
        self.log: list[Any] = []


class _Actor:
    """The rollout actor's calls, logged; each rollout returns a fixed two-prompt carry in its wire form."""

    def __init__(self, events: _Events) -> None:
        self.events = events

    def rollout_to_tq(self, input_batch: BatchedDataDict, **kwargs: Any) -> tuple[KVBatchMeta, dict[str, Any], Any]:
        self.events.log.append(("rollout", input_batch.size, kwargs))
        carry: BatchedDataDict[Any] = BatchedDataDict(
            total_reward=torch.tensor([1.0, 0.0, 0.5, 0.5]), length=torch.tensor([3, 3, 5, 5])
        )
        meta = KVBatchMeta(kwargs["partition_id"], [f"k{i}" for i in range(4)], sequence_lengths=[8] * 4)
        return meta, encode_carry(carry, kwargs["group_size"]), {"mean_gen_tokens_per_sample": 4.0}

    def record_step(self, meta: KVBatchMeta, request: Any, rows_from: Any = None) -> str:
        self.events.log.append(("record", list(meta.keys)))
        return "file"

    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]:
        self.events.log.append(("actor_counters", reset))
        return {"data_plane/put/bytes": 7.0}

    def shutdown(self) -> bool:
        self.events.log.append("shutdown")
        return True


class _Generation:
    def __init__(self, events: _Events) -> None:
        self.events = events

    def prepare_for_generation(self) -> bool:
        self.events.log.append("prepare_for_generation")
        return True


class _KvSync:
    def __init__(self, events: _Events) -> None:
        self.events = events

    def before_first_refit(self, batch: BatchedDataDict) -> None:
        self.events.log.append(("kv", batch.size))


def _source(events: _Events, timer: Timer) -> ActorSource:
    spec = RolloutSpec("train", G, ["total_reward", "length"], text_rows=1)

    def start(counters: dict[str, float]) -> None:
        events.log.append(("start_step", counters))

    generation: Any = _Generation(events)  # the two calls a rollout makes of them
    kv_sync: Any = _KvSync(events)
    return ActorSource(_Actor(events), generation, kv_sync, timer, spec, start)


def test_actor_source_runs_the_generation_phases_in_order() -> None:
    events, timer = _Events(), Timer()
    source: RolloutSource = _source(events, timer)
    prompts: BatchedDataDict[Any] = BatchedDataDict(message_log=[["a"], ["b"]])
    out = source.next(prompts, 1, first_batch=True, step_starts=True)
    want_kwargs = {"partition_id": "train", "group_size": G, "first_iter": True, "carry_keys": ["total_reward", "length"],
                   "text_rows": 1}  # fmt: skip
    assert events.log == [
        ("kv", 4),  # the prompts, repeated G times
        "prepare_for_generation",
        ("actor_counters", True),
        ("start_step", {"data_plane/put/bytes": 7.0}),
        ("rollout", 4, want_kwargs),
    ]
    assert set(timer.get_timing_metrics("sum")) == {"data_processing", "refit", "data_plane", "generation"}
    assert isinstance(out, Rollout) and out.meta.keys == ["k0", "k1", "k2", "k3"] and not out.reference_in_store
    assert out.carry["total_reward"].tolist() == [1.0, 0.0, 0.5, 0.5] and out.carry["length"].dtype == torch.int64
    assert out.metrics == {"mean_gen_tokens_per_sample": 4.0}

    # a later generation batch of a step still collecting groups: no new counters, no snapshot of step metrics
    events.log.clear()
    source.next(prompts, 1, first_batch=False, step_starts=False)
    assert [e[0] if isinstance(e, tuple) else e for e in events.log] == ["kv", "prepare_for_generation", "rollout"]
    assert events.log[-1][2]["first_iter"] is False

    events.log.clear()
    request: Any = object()
    source.record(out.meta, request)
    assert source.store_metrics() == {"data_plane/put/bytes": 7.0} and source.after_step(1) == {}
    with source.validating():
        pass
    source.close()
    assert events.log == [("record", ["k0", "k1", "k2", "k3"]), ("actor_counters", True), "shutdown"]


def test_received_decodes_the_carry_and_counts_its_wire_bytes() -> None:
    carry: BatchedDataDict[Any] = BatchedDataDict(truncated=torch.tensor([True, False]), length=torch.tensor([7, 7]))
    wire = encode_carry(carry, 2)
    meta = KVBatchMeta("train", ["a", "b"])
    out = received(meta, wire, {}, reference_in_store=True)
    assert out.carry_bytes == wire_nbytes(wire) < 2 * (1 + 8)  # bits and one length per prompt, not two columns
    assert torch.equal(out.carry["truncated"], carry["truncated"]) and torch.equal(out.carry["length"], carry["length"])
    assert out.reference_in_store

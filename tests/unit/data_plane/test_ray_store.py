"""The `ray` backend across processes: workers in other Ray processes attach to the named store by name, fetch
exactly their own keys and write results back under the same keys; ownership decides who stops the actor."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import DataPlaneClosedError, KVBatchMeta
from relayrl.data_plane.ray_store import column_from_wire, column_to_wire

ray = pytest.importorskip("ray")

NAME = "relayrl_data_plane_test_cross_process"
CFG = DataPlaneConfig(enabled=True, backend="ray", storage_capacity=1_000)


def test_wire_round_trip_is_bit_exact_for_every_dtype() -> None:
    lens = torch.tensor([3, 0, 2])
    for dtype in (torch.int64, torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.uint8):
        values = torch.randn(5, 2).to(dtype)
        for col in (Column(values, lens), Column(values[:3])):
            back = column_from_wire(column_to_wire(col), copy=True)
            assert back.dtype == dtype and torch.equal(back.values, col.values)
            assert (back.lengths is None) == (col.lengths is None)
            assert back.lengths is None or torch.equal(back.lengths, lens)


def _build(bootstrap: bool) -> Any:
    from relayrl.data_plane.ray_store import build_client

    return build_client(CFG, bootstrap=bootstrap, actor_name=NAME)


@pytest.fixture
def owner(ray_cluster: None) -> Iterator[Any]:  # noqa: F811
    client = _build(True)
    try:
        yield client
    finally:
        client.close()


@pytest.mark.ray
def test_workers_in_other_processes_fetch_exactly_their_keys_and_write_back(owner: Any) -> None:
    n, dp = 8, 2
    lens = torch.arange(1, n + 1)  # [N] row i has i + 1 tokens
    ids = Column(torch.arange(int(lens.sum())), lens)
    reward = torch.arange(n, dtype=torch.float32) * 0.5
    keys = [f"u{i // 2}_g{i % 2}" for i in range(n)]
    owner.register_partition("train", ["input_ids", "reward", "logprobs"], n, ["train"])
    meta = owner.put_samples(keys, "train", {"input_ids": ids, "reward": reward})
    meta.sequence_lengths = lens.tolist()
    shards = [meta.slice(r * n // dp, (r + 1) * n // dp) for r in range(dp)]

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self) -> None:
            from relayrl.data_plane.ray_store import build_client

            self.client = build_client(CFG, bootstrap=False, actor_name=NAME)

        def step(self, shard: KVBatchMeta) -> tuple[int, list[list[int]], list[float]]:
            got = self.client.get_samples(shard.keys, shard.partition_id, ["input_ids", "reward"])
            ids_col = got["input_ids"]
            rows = [ids_col.row(i).tolist() for i in range(ids_col.num_rows)]
            # write back one float per token, under the same keys
            lp = Column(ids_col.values.to(torch.float32) * -0.1, ids_col.lengths)
            self.client.put_samples(shard.keys, shard.partition_id, {"logprobs": lp})
            self.client.close()  # an attached client never stops the shared store
            return os.getpid(), rows, got["reward"].values.tolist()

    workers = [Worker.remote() for _ in range(dp)]  # type: ignore[attr-defined]
    results = ray.get([w.step.remote(s) for w, s in zip(workers, shards)], timeout=120)
    for shard, (pid, rows, rewards) in zip(shards, results):
        assert pid != os.getpid()
        want = [keys.index(k) for k in shard.keys]
        assert rows == [ids.row(i).tolist() for i in want]
        assert rewards == [float(reward[i]) for i in want]
    back = owner.get_samples(keys, "train", ["logprobs"])["logprobs"]
    assert torch.equal(back.values, ids.values.to(torch.float32) * -0.1) and torch.equal(back.lengths, lens)
    assert owner.clear_samples(None, "train") == n
    for w in workers:
        ray.kill(w)


@pytest.mark.ray
def test_bootstrap_attach_and_ownership(ray_cluster: None) -> None:  # noqa: F811
    from relayrl.data_plane.ray_store import _lookup

    with pytest.raises(RuntimeError, match="bootstrap=True"):
        _build(False)
    owner = _build(True)
    try:
        with pytest.raises(RuntimeError, match="already runs"):
            _build(True)
        worker = _build(False)
        worker.register_partition("p", ["x"], 1, ["t"])
        worker.close()
        worker.close()
        with pytest.raises(DataPlaneClosedError):
            worker.put_samples(["a"], "p", {"x": torch.tensor([1.0])})
        owner.put_samples(["a"], "p", {"x": torch.tensor([1.0])})  # the store survived the worker's close
        assert owner.bytes_held() == {"p": 4}
    finally:
        owner.close()
    deadline = time.monotonic() + 30
    while _lookup(NAME) is not None and time.monotonic() < deadline:  # the kill lands asynchronously
        time.sleep(0.2)
    assert _lookup(NAME) is None  # the owner's close stopped the actor


def test_build_without_ray_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.data_plane import ray_store

    monkeypatch.setattr(ray_store.ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="ray.init"):
        ray_store.build_client(CFG, bootstrap=True)


@pytest.mark.ray
def test_a_wedged_store_ends_each_call_at_data_plane_call_timeout_s(ray_cluster: None) -> None:  # noqa: F811
    """Issue 28 item 5: the store's actor process stops answering (SIGSTOP: a real hang); a call on it ends at
    data_plane.call_timeout_s with one line naming the call and the key (a DeadlineError: the CLI exits 1)."""
    import signal

    from relayrl.data_plane.ray_store import build_client
    from relayrl.utils.deadlines import DeadlineError

    owner = build_client(CFG, bootstrap=True, actor_name=f"{NAME}_wedged")
    cfg = DataPlaneConfig(enabled=True, backend="ray", storage_capacity=1_000, call_timeout_s=0.5)
    client = build_client(cfg, bootstrap=False, actor_name=f"{NAME}_wedged")  # a worker's client
    pid = ray.get(owner._actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(DeadlineError) as err:
            client.register_partition("train", ["reward"], 2, ["train"])
        assert time.monotonic() - start < 10
        assert str(err.value) == (
            "ray data plane register_partition on partition 'train' did not finish within 0.5s "
            "(data_plane.call_timeout_s)"
        )
    finally:
        os.kill(pid, signal.SIGCONT)
        client.close()
        owner.close()


def test_a_ledger_call_is_named_with_its_partition() -> None:
    """What a timed-out call's line says: the method and, where it takes one, the partition."""
    from relayrl.data_plane.ledger import Ledger
    from relayrl.data_plane.remote import call_name

    assert call_name(Ledger.claim_meta, ("rollout", "train", ["x"], 4), {}) == "claim_meta on partition 'rollout'"
    assert call_name(Ledger.register_partition, (), {"partition_id": "val", "fields": ["x"]}) == (
        "register_partition on partition 'val'"
    )
    assert call_name(Ledger.close, (), {}) == "close"
    assert call_name(Ledger.claim_meta, (1, 2, 3, 4, 5, 6, 7, 8, 9), {}) == "claim_meta"  # unbindable: the name alone

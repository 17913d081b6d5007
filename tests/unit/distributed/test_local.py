"""LocalWorkerGroup and its in-process collectives: dispatch, rank order, sums, broadcast, error handling."""

from __future__ import annotations

import threading

import pytest
import torch

from relayrl.distributed.interfaces import Collective, WorkerGroup
from relayrl.distributed.local import LocalWorkerGroup, SingleProcessCollective, ThreadCollective
from relayrl.utils.deadlines import DeadlineError
from tests.helpers import tight_deadlines
from tests.unit.distributed.toy_worker import CollectiveToyWorker


class ToyWorker(CollectiveToyWorker):
    """Holds a rank-dependent tensor; methods exercise every collective."""

    def __init__(self, *, rank: int, comm: Collective, scale: float = 1.0) -> None:
        self.rank = rank
        self.comm = comm
        self.value = torch.full((3,), float(rank + 1) * scale)  # [3]
        self.closed = False

    def whoami(self, suffix: str = "") -> str:
        return f"rank{self.rank}/{self.comm.world_size}{suffix}"

    def double(self, shard: list[int]) -> list[int]:
        return [2 * x for x in shard]

    def fail_on(self, bad_rank: int) -> torch.Tensor:
        if self.rank == bad_rank:
            raise ValueError(f"rank {self.rank} failed on purpose")
        return self.total()  # the healthy ranks block here until the failure aborts the barrier

    def hang_on(self, stuck_rank: int, release: threading.Event) -> torch.Tensor | None:
        """Rank `stuck_rank` hangs (never reaches the collective) until `release`; the others sum."""
        if self.rank == stuck_rank:
            release.wait(30)
            return None
        return self.total()

    def shutdown(self) -> bool:
        self.closed = True
        return True


def nope(worker: ToyWorker) -> None:
    """A function that is no method of ToyWorker: dispatch looks the name up on the worker and fails."""


@pytest.mark.parametrize("n", [1, 3])
def test_dispatch_in_rank_order(n: int) -> None:
    group = LocalWorkerGroup(ToyWorker, n, scale=2.0)
    assert isinstance(group, WorkerGroup) and group.world_size == n
    assert group.run_all(ToyWorker.whoami, suffix="!") == [f"rank{r}/{n}!" for r in range(n)]
    shards = [[r, r + 10] for r in range(n)]
    assert group.run_sharded(ToyWorker.double, shards) == [[2 * r, 2 * r + 20] for r in range(n)]
    assert group.run_rank0(ToyWorker.whoami) == f"rank0/{n}"
    assert group.worker(n - 1).rank == n - 1
    assert group.worker(0).value[0].item() == 2.0  # init kwargs reach every worker


@pytest.mark.parametrize("n", [1, 2, 4])
def test_all_reduce_sum_is_identical_on_every_rank(n: int) -> None:
    group = LocalWorkerGroup(ToyWorker, n)
    totals = group.run_all(ToyWorker.total)
    expected = torch.full((3,), float(n * (n + 1) // 2))
    for t in totals:
        assert torch.equal(t, expected)
    # repeated calls reuse the same hub safely
    assert all(torch.equal(t, expected) for t in group.run_all(ToyWorker.total))


def test_broadcast_and_gather() -> None:
    group = LocalWorkerGroup(ToyWorker, 3)
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in group.run_all(ToyWorker.take_from, 2))
    assert group.run_all(ToyWorker.gather, "x") == [[(0, "x"), (1, "x"), (2, "x")]] * 3
    with pytest.raises(ValueError, match="source rank 5"):
        group.run_all(ToyWorker.take_from, 5)


def test_failure_on_one_rank_raises_root_cause_and_group_recovers() -> None:
    group = LocalWorkerGroup(ToyWorker, 3)
    with pytest.raises(ValueError, match="rank 1 failed on purpose"):
        group.run_all(ToyWorker.fail_on, 1)
    assert all(torch.equal(t, torch.full((3,), 6.0)) for t in group.run_all(ToyWorker.total))
    assert threading.active_count() < 10  # no worker thread left blocked at a barrier


def test_bad_calls_are_named() -> None:
    group = LocalWorkerGroup(ToyWorker, 2)
    with pytest.raises(ValueError, match="3 shards for 2 workers"):
        group.run_sharded(ToyWorker.double, [[1], [2], [3]])
    with pytest.raises(AttributeError, match="no method 'nope'"):
        group.run_all(nope)
    with pytest.raises(TypeError, match="by reference"):
        group.run_all("whoami")  # type: ignore[arg-type]  # names are not a dispatch API
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        LocalWorkerGroup(ToyWorker, 0)


def test_shutdown_is_idempotent_and_closes_workers() -> None:
    group = LocalWorkerGroup(ToyWorker, 2)
    workers = [group.worker(0), group.worker(1)]
    assert group.shutdown() and group.shutdown()
    assert all(w.closed for w in workers)
    with pytest.raises(RuntimeError, match="shut down"):
        group.run_all(ToyWorker.whoami)


def test_single_process_collective_is_identity() -> None:
    comm = SingleProcessCollective()
    assert isinstance(comm, Collective) and comm.rank == 0 and comm.world_size == 1
    t = torch.tensor([1.5, -2.0])
    comm.all_reduce_sum(t)
    comm.broadcast(t, src=0)
    assert t.tolist() == [1.5, -2.0] and comm.all_gather_object("a") == ["a"]


def test_thread_collective_ranks() -> None:
    comms = ThreadCollective.create_group(2)
    assert [c.rank for c in comms] == [0, 1] and all(c.world_size == 2 for c in comms)
    assert all(isinstance(c, Collective) for c in comms)


def test_a_rank_that_never_joins_ends_the_collective_and_the_call(monkeypatch) -> None:
    """Issue 28 item 5: rank 2 hangs; ranks 0 and 1 wait at the collective's barrier until
    cluster.collective_timeout_s (the driver's join of the rank threads, at cluster.call_timeout_s, later), the
    error naming the collective and the rank that waited."""
    group = LocalWorkerGroup(ToyWorker, 3)
    tight_deadlines(monkeypatch, collective_timeout_s=0.2, call_timeout_s=2.0)  # the barrier gives up first
    release = threading.Event()
    try:
        with pytest.raises(DeadlineError) as err:
            group.run_all(ToyWorker.hang_on, 2, release)
    finally:
        release.set()
    assert str(err.value) in {
        f"rank {r}'s all_reduce_sum (in-process group of 3: another rank never joined) did not finish within 0.2s "
        "(cluster.collective_timeout_s)"
        for r in (0, 1)
    }


def test_a_hung_rank_ends_the_drivers_join(monkeypatch) -> None:
    group = LocalWorkerGroup(ToyWorker, 2)
    tight_deadlines(monkeypatch, call_timeout_s=0.2)
    release = threading.Event()
    try:
        with pytest.raises(DeadlineError) as err:
            group.run_all(ToyWorker.hang_on, 1, release)  # rank 0 waits in the collective (default deadline)
    finally:
        release.set()
    for t in [t for t in threading.enumerate() if t.name.startswith("local-worker-")]:
        t.join(10)  # the rank left waiting in the collective was released when the join gave up
        assert not t.is_alive()
    assert str(err.value) == (
        "local executor ranks [0, 1] of 2 in 'hang_on' did not finish within 0.2s (cluster.call_timeout_s)"
    )

"""The local executor: workers are plain objects in the driver process.

With one worker a call is a direct method call (no threads, exceptions propagate as they are). With several
workers each call runs one thread per worker so that their collectives (gradient sums, count sums) can meet at a
barrier; torch kernels release the GIL, so this is real data parallelism on a multi-core host and, above all, it
exercises exactly the code path a multi-process group runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import torch

from relayrl.distributed.interfaces import method_name
from relayrl.utils import deadlines

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


class SingleProcessCollective:
    """The collective of a data-parallel group of one: every operation is the identity."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        return None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if src != 0:
            raise ValueError(f"broadcast source rank {src} does not exist in a group of 1")

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class _ThreadHub:
    """State shared by the ranks of one in-process group: a barrier and one exchange slot per rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list[Any] = [None] * world_size
        self.aborted = False  # set by abort(): a broken barrier is then another rank's failure, not a deadline

    def exchange(self, rank: int, value: Any, op: str) -> list[Any]:
        """Publish `value`, wait for every rank, and return all published values (valid until `done`)."""
        self.slots[rank] = value
        self.meet(rank, op)
        return self.slots

    def done(self, rank: int, op: str) -> None:
        """Second barrier: nobody reuses the slots (or mutates a published tensor) until everyone has read them."""
        self.meet(rank, op)

    def meet(self, rank: int, op: str) -> None:
        """The barrier, within the collective deadline: past it, `DeadlineError` naming the operation and rank."""
        limit = deadlines.deadline("collective")
        try:
            self.barrier.wait(limit.seconds)
        except threading.BrokenBarrierError:
            if self.aborted:
                raise
            raise limit.error(
                f"rank {rank}'s {op} (in-process group of {self.world_size}: another rank never joined)"
            ) from None


class ThreadCollective:
    """One rank's view of an in-process group whose ranks run in separate threads."""

    def __init__(self, hub: _ThreadHub, rank: int) -> None:
        self._hub = hub
        self._rank = rank

    @classmethod
    def create_group(cls, world_size: int) -> list[ThreadCollective]:
        """One collective per rank, all sharing a hub."""
        hub = _ThreadHub(world_size)
        return [cls(hub, r) for r in range(world_size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._hub.world_size

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        slots = self._hub.exchange(self._rank, tensor, "all_reduce_sum")
        # Every rank adds in rank order, so all ranks get bitwise-identical sums.
        total = slots[0].detach().clone()
        for other in slots[1:]:
            total += other.to(total.device)
        self._hub.done(self._rank, "all_reduce_sum")
        tensor.copy_(total)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast source rank {src} does not exist in a group of {self.world_size}")
        slots = self._hub.exchange(self._rank, tensor, "broadcast")
        if self._rank != src:
            tensor.copy_(slots[src])
        self._hub.done(self._rank, "broadcast")

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered = list(self._hub.exchange(self._rank, obj, "all_gather_object"))
        self._hub.done(self._rank, "all_gather_object")
        return gathered

    def abort(self) -> None:
        """Release ranks blocked at the barrier (they raise BrokenBarrierError) after another rank failed."""
        self._hub.aborted = True
        self._hub.barrier.abort()

    def reset(self) -> None:
        """Make the group usable again once every thread has returned."""
        self._hub.barrier.reset()
        self._hub.aborted = False
        self._hub.slots = [None] * self._hub.world_size


class LocalWorkerGroup(Generic[W]):
    """`num_workers` workers built in this process; worker r is `worker_cls(rank=r, comm=<collective>, **kwargs)`."""

    def __init__(self, worker_cls: Callable[..., W], num_workers: int = 1, **init_kwargs: Any) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._comms: list[Any]
        if num_workers == 1:
            self._comms = [SingleProcessCollective()]
        else:
            self._comms = ThreadCollective.create_group(num_workers)
        self._workers: list[W] = []
        # Workers are built concurrently too: their constructors may use collectives (e.g. broadcast rank 0's
        # freshly initialised weights so every replica starts identical).
        calls = [partial(worker_cls, rank=r, comm=c, **init_kwargs) for r, c in enumerate(self._comms)]
        self._workers = self._parallel(calls, f"building {getattr(worker_cls, '__name__', 'the workers')}")
        self._closed = False

    # ------------------------------------------------------------------ WorkerGroup protocol
    @property
    def world_size(self) -> int:
        return len(self._comms)

    @property
    def node_ids(self) -> None:
        """In-process workers are not placed on nodes."""
        return None

    def run_all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return self._parallel(
            [self._bound(w, method, *args, **kwargs) for w in self._live_workers()], method_name(method)
        )

    def run_sharded(
        self, method: Callable[Concatenate[W, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        workers = self._live_workers()
        if len(shards) != len(workers):
            raise ValueError(f"run_sharded got {len(shards)} shards for {len(workers)} workers")
        return self._parallel(
            [self._bound(w, method, s, *args, **kwargs) for w, s in zip(workers, shards)], method_name(method)
        )

    def run_rank0(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return self._bound(self._live_workers()[0], method, *args, **kwargs)()

    def shutdown(self) -> bool:
        if not self._closed:
            for w in self._workers:
                close = getattr(w, "shutdown", None)
                if callable(close):
                    close()
            self._workers = []
            self._closed = True
        return True

    # ------------------------------------------------------------------ local-only access
    def worker(self, rank: int = 0) -> W:
        """The worker object itself (local executor only): lets a colocated engine read live weights, no copy."""
        return self._live_workers()[rank]

    # ------------------------------------------------------------------ internals
    def _live_workers(self) -> list[W]:
        if self._closed:
            raise RuntimeError("this worker group has been shut down")
        return self._workers

    @staticmethod
    def _bound(worker: W, method: Callable[..., R], *args: Any, **kwargs: Any) -> Callable[[], R]:
        """`worker.<method name>(*args, **kwargs)` as a thunk: looked up by name, so an override runs."""
        name = method_name(method)
        fn = getattr(worker, name, None)
        if not callable(fn):
            raise AttributeError(f"{type(worker).__name__} has no method {name!r}")
        return lambda: fn(*args, **kwargs)

    def _parallel(self, calls: Sequence[Callable[[], R]], what: str) -> list[R]:
        """Run one call per rank; with several ranks each in its own thread. Re-raises the first real error."""
        if len(calls) == 1:
            return [calls[0]()]
        results: list[Any] = [None] * len(calls)
        errors: list[BaseException | None] = [None] * len(calls)

        def target(r: int) -> None:
            try:
                results[r] = calls[r]()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the driver thread below
                errors[r] = exc
                self._comms[r].abort()

        # daemon: a rank stuck past the call deadline is left behind, and never keeps the process alive
        threads = [
            threading.Thread(target=target, args=(r,), name=f"local-worker-{r}", daemon=True) for r in range(len(calls))
        ]
        for t in threads:
            t.start()
        limit = deadlines.deadline("call")
        end = time.monotonic() + limit.seconds
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        failed = [e for e in errors if e is not None]
        if stuck:  # a rank still runs: the run cannot go on; ranks blocked in a collective are released
            for c in self._comms:
                c.abort()
            root = next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)), None)
            raise root or limit.error(f"local executor ranks {stuck} of {len(calls)} in {what!r}")
        if failed:
            for c in self._comms:
                c.reset()
            # A rank released by abort() raises BrokenBarrierError; report the rank that actually failed.
            root = next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)), failed[0])
            raise root
        return results

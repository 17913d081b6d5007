"""Typed contracts between a driver-side façade (Policy, Value) and the workers that do the compute.

Two small protocols keep the façade ignorant of where workers live:

* `WorkerGroup`: how the driver calls every worker (same arguments, or one data shard each) and collects results.
  The local executor hosts workers as plain objects in the driver process; a Ray group hosts them as actors. Both
  block until every worker has answered and return results in rank order. Callers name the worker method by
  reference (`group.run_sharded(PolicyWorker.train, shards, ...)`), so mypy checks the arguments against the
  method's signature and types the results; only the Ray transport sends the method's name over the wire.
* `Collective`: how workers of one data-parallel group talk to each other (sum gradients and global counts,
  broadcast initial weights, gather small python objects). On the local executor it is a no-op for one worker or a
  thread barrier for several; under Ray it wraps a torch.distributed process group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, runtime_checkable

import torch

W_co = TypeVar("W_co", covariant=True)
P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


@runtime_checkable
class Collective(Protocol):
    """Data-parallel communication seen from one rank. Every rank must make the same calls in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Replace `tensor` (in place) by the element-wise sum over ranks; identical on every rank."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite `tensor` (in place) on every rank with rank `src`'s values."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (small picklable objects only)."""


@runtime_checkable
class WorkerGroup(Protocol[W_co]):
    """A fixed set of workers of type `W_co`, one per data-parallel rank, driven by method reference.

    `method` is the unbound worker method (`Worker.method`); it is looked up on each worker by name, so a
    subclass's override runs, as a plain method call would.
    """

    @property
    def world_size(self) -> int: ...

    @property
    def node_ids(self) -> Sequence[str] | None:
        """The Ray node of each worker in rank order (where a colocated generation worker must run); None when the
        workers are not placed on nodes (in-process)."""

    def run_all(self, method: Callable[Concatenate[W_co, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call `worker.method(*args, **kwargs)` on every worker; results in rank order."""

    def run_sharded(
        self, method: Callable[Concatenate[W_co, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """Call `worker_r.method(shards[r], *args, **kwargs)` (one shard per worker); results in rank order."""

    def run_rank0(self, method: Callable[Concatenate[W_co, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Call `method` on rank 0 only (checkpoint writes, refit metadata)."""

    def shutdown(self) -> bool:
        """Release the workers; idempotent."""


def method_name(method: Callable[..., Any]) -> str:
    """The attribute name a worker method is dispatched by; a string is refused (pass `Worker.method` itself)."""
    if isinstance(method, str):
        raise TypeError(f"worker methods are passed by reference (e.g. Worker.{method}), not by name {method!r}")
    name = getattr(method, "__name__", None)
    if not callable(method) or not isinstance(name, str):
        raise TypeError(f"expected a worker method such as Worker.train, got {method!r}")
    return name

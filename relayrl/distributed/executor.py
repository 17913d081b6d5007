"""Pick the executor for a worker group from the `cluster` config block.

Façades (Policy, Value) build their workers through `build_worker_group` and never name an executor: the local
one hosts workers in this process, the Ray one hosts each rank in its own actor with a torch.distributed
collective. Ray is imported only when the Ray executor is chosen, so the local path works without it installed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from relayrl.config import ClusterConfig
from relayrl.distributed.interfaces import WorkerGroup, method_name
from relayrl.distributed.local import LocalWorkerGroup

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")


class PendingResults(Protocol[R]):
    """A call already started on every rank (`run_all_async`): `result()` waits and returns `run_all`'s list."""

    def result(self, timeout: float | None = None) -> list[R]: ...


def world_size(cluster: ClusterConfig) -> int:
    """Number of data-parallel ranks the cluster block asks for."""
    return cluster.num_nodes * cluster.workers_per_node


def build_worker_group(worker_cls: Callable[..., W], cluster: ClusterConfig, **init_kwargs: Any) -> WorkerGroup[W]:
    """One worker per rank, built as `worker_cls(rank=r, comm=<collective>, **init_kwargs)` on every rank.

    `local`: workers are objects in this process (threads + an in-process collective when there are several).
    `ray`: one actor per rank in a placement group; joins `cluster.ray_address` or starts a local Ray if none is
    running. Worker classes and init kwargs must be picklable for Ray.
    """
    return _build(worker_cls, cluster, None, init_kwargs)


def build_worker_group_on_nodes(
    worker_cls: Callable[..., W], cluster: ClusterConfig, node_ids: Sequence[str] | None, **init_kwargs: Any
) -> WorkerGroup[W]:
    """`build_worker_group`, with rank r on Ray node `node_ids[r]` (colocated generation workers next to their
    training ranks) when node_ids is given; None: placed as `build_worker_group` places them."""
    return _build(worker_cls, cluster, node_ids, init_kwargs)


def _build(
    worker_cls: Callable[..., W], cluster: ClusterConfig, node_ids: Sequence[str] | None, init_kwargs: dict[str, Any]
) -> WorkerGroup[W]:
    if not isinstance(cluster, ClusterConfig):
        raise TypeError(f"build_worker_group: cluster must be a ClusterConfig, got {type(cluster).__name__}")
    if cluster.executor == "local":
        if node_ids is not None:
            raise ValueError("build_worker_group: node_ids places Ray actors; the local executor has none")
        return LocalWorkerGroup(worker_cls, world_size(cluster), **init_kwargs)
    if cluster.executor == "ray":
        try:
            from relayrl.distributed.ray_executor import RayWorkerGroup
        except ImportError as exc:
            raise ImportError(
                "cluster.executor='ray' needs Ray: install relayrl with the 'ray' extra (pip install 'relayrl[ray]')"
            ) from exc
        return RayWorkerGroup(worker_cls, cluster, node_ids=node_ids, **init_kwargs)
    raise ValueError(f"cluster.executor must be 'local' or 'ray', got {cluster.executor!r}")


def run_all_async(
    group: WorkerGroup[W], method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
) -> PendingResults[R]:
    """Start `method` on every worker without waiting; the returned future's `result()` is `run_all`'s list.

    Needed where the driver must join the same collective as the workers (weight-update group set-up, collective
    refit, ZMQ streaming to a receiver the driver runs): a Ray group starts its actors' calls; any other group
    runs `run_all` in a background thread.
    """
    name = method_name(method)  # a bad method fails here, in the caller's thread
    start = getattr(group, "run_all_async", None)
    if callable(start):
        pending: PendingResults[R] = start(method, *args, **kwargs)
        return pending
    future: Future[list[R]] = Future()

    def target() -> None:
        try:
            future.set_result(group.run_all(method, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            future.set_exception(exc)

    threading.Thread(target=target, name=f"run_all_async-{name}", daemon=True).start()
    return future

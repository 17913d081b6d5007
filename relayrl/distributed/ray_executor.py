"""The Ray executor: one Ray actor per data-parallel rank, behind the same `WorkerGroup` API as the local one.

Layout: the ranks' placement group (`ray_placement`: a bundle per rank, or per node on distinct nodes) reserves the
resources up front, so a group either starts whole or fails with a clear message. Each actor hosts exactly one
worker (`worker_cls(rank=r, comm=<collective>, **kwargs)`); the collective is a `TorchDistCollective` (gloo on CPU,
nccl on CUDA) rendezvousing through the env vars the group sets (RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK,
MASTER_ADDR, MASTER_PORT, and RELAYRL_NODE_ID, the Ray node id). A group given `node_ids` has no placement group:
rank r is pinned to node `node_ids[r]` (colocated generation workers next to their training ranks).

Failure model: a rank whose process dies (OOM kill, `ray.kill`, node loss) makes every call fail within seconds
with `WorkerDiedError("rank r (..., node id ...) died ...")`; the survivors are usually blocked inside a collective
waiting for the dead peer, so the whole group is torn down (a data-parallel group cannot continue without a rank).
A Python error on one rank is re-raised as is, unless it says a collective peer is gone (gloo's "Connection closed
by peer") and a rank of this driver's groups died or sat on a node Ray reports dead: then it is that rank's
`WorkerDiedError`. If the other ranks do not finish within `error_grace_s` they are stuck in a collective and the
group is torn down too. A group shut down while a call still runs on it is killed, not drained: its teardown
would queue behind that call (a refit stream whose sender died).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from relayrl.config import ClusterConfig
from relayrl.distributed.errors import (
    RemoteTimeoutError,
    WorkerDiedError,
    caused_by,
    node_loss_error,
    says_peer_lost,
    unnamed_peer_loss,
)
from relayrl.distributed.interfaces import method_name
from relayrl.distributed.ray_nodes import NODE_ID_ENV
from relayrl.distributed.ray_placement import (
    check_cluster_fits,
    ensure_ray,
    node_and_local_rank,
    rank_bundle,
    rank_strategy,
    reserve,
)
from relayrl.distributed.refit import private_ipc_dir

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")

#: How long a peer's loss may take to show as a dead Ray node (Ray's health checks: 3 s period, 5 misses).
PEER_LOSS_WAIT_S = 30.0

# Driver env vars forwarded to every rank (a joined cluster's workers do not inherit the driver's environment).
_FORWARDED_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "TOKENIZERS_", "RELAYRL_", "CUBLAS_", "NCCL_", "GLOO_", "TORCH_")


def death_site(exc: BaseException) -> str:
    """Where a Ray actor died, from Ray's error text: its pid and node address, in a few words."""
    text = str(exc)
    pid = re.search(r"\bpid: (\d+)", text)
    ip = re.search(r"\bip: ([\w.:-]+)", text)
    found = [f"pid {pid.group(1)}" if pid else "", f"node {ip.group(1)}" if ip else ""]
    return ", ".join(f for f in found if f) or type(exc).__name__


def get_within(ref: Any, timeout_s: float, what: str, key: str) -> Any:
    """`ray.get(ref)` with a deadline: RemoteTimeoutError "<what> did not answer within Ns (<key>)" past it."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError as exc:
        raise RemoteTimeoutError(f"{what} did not answer within {timeout_s:g}s ({key})") from exc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _quiet_stop_in_finalizers() -> None:
    """Drop the "Exception ignored in __del__" traceback of a process being stopped; report every other one.

    Tearing a group down stops its surviving ranks; Ray's SIGTERM handler raises SystemExit wherever the rank is,
    and when that is inside a finalizer (a ZMQ socket's `__del__`, say) Python prints a traceback that Ray forwards
    to the driver's terminal, right under relayrl's one-line error. Nothing is lost: the process is exiting.
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, (SystemExit, KeyboardInterrupt)):
            return
        previous(unraisable)

    sys.unraisablehook = hook


class _RankHost:
    """Lives inside one actor process: owns that rank's collective and worker, and calls worker methods."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str]) -> None:
        _quiet_stop_in_finalizers()
        os.environ.update(env)
        self._rank = rank
        self._world_size = world_size
        self._worker: Any = None
        self._comm: Any = None

    def node_info(self) -> dict[str, Any]:
        """Where this rank runs (to derive LOCAL_RANK / NODE_RANK) and a free port for a rendezvous."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "port": _free_port(),
        }

    def setup(
        self,
        env: dict[str, str],
        payload: bytes,
        num_threads: int | None,
        deterministic: bool,
        retain_freed_memory: bool = True,
    ) -> int:
        """Join the process group and build the worker. The payload is unpickled only after the env is set."""
        os.environ.update(env)
        from relayrl.distributed.local import SingleProcessCollective
        from relayrl.utils import device as dev

        dev.apply_runtime_settings(deterministic, num_threads, retain_freed_memory)
        if self._world_size > 1:
            from relayrl.distributed.torch_collective import TorchDistCollective

            self._comm = TorchDistCollective(self._rank, self._world_size)
        else:
            self._comm = SingleProcessCollective()
        worker_cls, kwargs = cloudpickle.loads(payload)
        self._worker = worker_cls(rank=self._rank, comm=self._comm, **kwargs)
        return os.getpid()

    # The group sends a method's name (the transport detail of dispatch by reference; functions of classes
    # defined in a test or `__main__` would not unpickle here) and the actor looks it up on its worker.
    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn = getattr(self._worker, name, None)
        if not callable(fn):
            raise AttributeError(f"{type(self._worker).__name__} has no method {name!r}")
        return fn(*args, **kwargs)

    def call_common(self, name: str, common: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = common
        return self.call(name, args, kwargs)

    def call_sharded(self, name: str, shard: Any, common: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = common
        return self.call(name, (shard, *args), kwargs)

    def teardown(self) -> bool:
        """Let the worker release what it holds, then leave the process group."""
        try:
            close = getattr(self._worker, "shutdown", None)
            if callable(close):
                close()
        finally:
            self._worker = None
            destroy = getattr(self._comm, "destroy", None)
            if callable(destroy):
                destroy()
        return True


class PendingCall(Generic[R]):
    """Results of a call already running on every rank; `wait()` collects them like `run_all` would."""

    def __init__(self, group: RayWorkerGroup[Any], refs: list[tuple[int, Any]], what: str) -> None:
        self._group = group
        self._refs = refs
        self._what = what

    def wait(self) -> list[R]:
        """Results in rank order; same failure handling (dead rank named, stuck group torn down) as `run_all`."""
        return self._group._gather(self._refs, self._what, self._group._call_timeout_s, self._group._call_key)

    def result(self, timeout: float | None = None) -> list[R]:
        """`concurrent.futures.Future`-style alias of `wait` (the group's own call timeout applies)."""
        return self.wait()


class RayWorkerGroup(Generic[W]):
    """`num_nodes x workers_per_node` ranks, each a Ray actor hosting `worker_cls(rank=r, comm=..., **kwargs)`."""

    def __init__(
        self,
        worker_cls: Callable[..., W],
        cluster: ClusterConfig,
        *,
        name: str = "relayrl",
        ready_timeout_s: float | None = None,
        error_grace_s: float = 10.0,
        call_timeout_s: float | None = None,
        poll_s: float = 0.5,
        node_ids: Sequence[str] | None = None,
        **init_kwargs: Any,
    ) -> None:
        self._world = cluster.num_nodes * cluster.workers_per_node
        self._name = name
        self._error_grace_s = error_grace_s
        self._call_timeout_s = cluster.call_timeout_s if call_timeout_s is None else call_timeout_s
        self._call_key = "cluster.call_timeout_s" if call_timeout_s is None else "call_timeout_s"
        self._start_key = "cluster.start_timeout_s" if ready_timeout_s is None else "ready_timeout_s"
        if ready_timeout_s is None:
            ready_timeout_s = cluster.start_timeout_s
        self._label = getattr(worker_cls, "__name__", name)
        self._poll_s = poll_s
        self._closed = False
        self._actors: list[Any] = []
        self._pg: PlacementGroup | None = None
        self._in_flight: dict[Any, int] = {}  # {ref: rank} of calls started on the ranks and not collected yet
        self.pids: list[int] = []  # one process per rank, in rank order
        self.node_ids: list[str] = []  # the Ray node of each rank, in rank order
        self._pinned = list(node_ids) if node_ids is not None else None
        if self._pinned is not None and len(self._pinned) != self._world:
            raise ValueError(f"node_ids names {len(self._pinned)} nodes for {self._world} ranks")
        self.placement_group_id: str | None = None
        self.started_ray = ensure_ray(cluster)
        try:
            self._start(worker_cls, cluster, ready_timeout_s, init_kwargs)
        except BaseException:
            self._teardown(graceful=False)
            raise
        _GROUPS.add(self)

    # ------------------------------------------------------------------ start-up
    def _start(self, worker_cls: Any, cluster: ClusterConfig, timeout: float, init_kwargs: dict[str, Any]) -> None:
        check_cluster_fits(rank_bundle(cluster), self._world)
        if self._pinned is None:  # `node_ids`: rank r on node node_ids[r], no placement group
            self._pg = reserve(cluster, self._name, timeout, self._start_key)
            self.placement_group_id = self._pg.id.hex()
        private_ipc_dir()  # this run's refit sockets: the directory's path travels to every rank in the env
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}
        actor_cls = ray.remote(_RankHost)
        for r in range(self._world):
            self._actors.append(
                actor_cls.options(
                    num_cpus=cluster.cpus_per_worker,
                    num_gpus=cluster.gpus_per_worker,
                    max_restarts=0,
                    scheduling_strategy=rank_strategy(r, cluster, self._pg, self._pinned),
                ).remote(r, self._world, {**env, "RANK": str(r), "WORLD_SIZE": str(self._world)})
            )
        infos = self._gather(
            [(r, a.node_info.remote()) for r, a in enumerate(self._actors)], "start-up", timeout, self._start_key
        )
        self.pids = [int(i["pid"]) for i in infos]
        self.node_ids = [str(i["node_id"]) for i in infos]
        payload = ray.put(cloudpickle.dumps((worker_cls, init_kwargs)))
        settings = (cluster.torch_num_threads, cluster.deterministic, cluster.retain_freed_memory)
        refs = []
        for r, (actor, info) in enumerate(zip(self._actors, infos)):
            node_rank, local_rank = node_and_local_rank(r, cluster, self.node_ids)
            rank_env = {
                "LOCAL_RANK": str(local_rank),
                "NODE_RANK": str(node_rank),
                NODE_ID_ENV: str(info["node_id"]),  # what pairs a colocated generation worker with its rank
                "MASTER_ADDR": str(infos[0]["ip"]),
                "MASTER_PORT": str(infos[0]["port"]),
            }
            refs.append((r, actor.setup.remote(rank_env, payload, *settings)))
        self._gather(refs, "worker construction", timeout, self._start_key)

    # ------------------------------------------------------------------ WorkerGroup protocol
    @property
    def world_size(self) -> int:
        return self._world

    @property
    def call_timeout_s(self) -> float:
        """Deadline of one call on the ranks (`cluster.call_timeout_s` unless given)."""
        return self._call_timeout_s

    def run_all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        name = method_name(method)
        actors = self._live_actors()
        common = ray.put((args, kwargs))  # serialised once, not once per rank
        refs = self._started([(r, a.call_common.remote(name, common)) for r, a in enumerate(actors)])
        return self._gather(refs, name, self._call_timeout_s, self._call_key)

    def run_sharded(
        self, method: Callable[Concatenate[W, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        name = method_name(method)
        actors = self._live_actors()
        if len(shards) != len(actors):
            raise ValueError(f"run_sharded got {len(shards)} shards for {len(actors)} workers")
        common = ray.put((args, kwargs))
        refs = self._started(
            [(r, a.call_sharded.remote(name, s, common)) for r, (a, s) in enumerate(zip(actors, shards))]
        )
        return self._gather(refs, name, self._call_timeout_s, self._call_key)

    def run_all_async(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> PendingCall[R]:
        """Start `method` on every rank and return at once (e.g. to join a collective the driver also joins)."""
        name = method_name(method)
        actors = self._live_actors()
        common = ray.put((args, kwargs))
        return PendingCall(
            self, self._started([(r, a.call_common.remote(name, common)) for r, a in enumerate(actors)]), name
        )

    def run_rank0(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        name = method_name(method)
        actor = self._live_actors()[0]
        result: R = self._gather(
            self._started([(0, actor.call.remote(name, args, kwargs))]), name, self._call_timeout_s, self._call_key
        )[0]
        return result

    def shutdown(self) -> bool:
        self._teardown(graceful=True)
        return True

    def actor(self, rank: int) -> Any:
        """The Ray actor handle hosting `rank` (for health checks and fault-injection tests)."""
        return self._live_actors()[rank]

    def __enter__(self) -> RayWorkerGroup[W]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _live_actors(self) -> list[Any]:
        if self._closed:
            raise RuntimeError("this worker group has been shut down (or lost a rank)")
        return self._actors

    def _started(self, refs: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        self._in_flight.update((ref, r) for r, ref in refs)
        return refs

    def _gather(self, refs: list[tuple[int, Any]], what: str, timeout: float | None, key: str = "") -> list[Any]:
        """Results in rank order; a dead rank or a stuck group ends the wait in bounded time (`timeout`, the config
        `key` it comes from named in the error)."""
        pending = {ref: r for r, ref in refs}
        results: dict[int, Any] = {}
        failure: BaseException | None = None
        failed_rank = -1
        start = time.monotonic()
        give_up = start + timeout if timeout is not None else None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self._poll_s)
            for ref in ready:
                rank = pending.pop(ref)
                self._in_flight.pop(ref, None)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as exc:
                    self._teardown(graceful=False)
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise WorkerDiedError(f"{self._died(rank, exc)} during {what!r}: {reason}") from exc
                except Exception as exc:  # noqa: BLE001 - a Python error on that rank, re-raised below
                    if failure is None:
                        failure, failed_rank = exc, rank
                        give_up = min(give_up or float("inf"), time.monotonic() + self._error_grace_s)
            if pending and failure is not None and says_peer_lost(failure):  # the others may wait for that peer
                lost = _peer_loss(failure, self._label, failed_rank, what)
                if lost is not None:
                    self._teardown(graceful=False)
                    raise lost
            if pending and give_up is not None and time.monotonic() > give_up:
                ranks = sorted(pending.values())
                self._teardown(graceful=False)
                if failure is not None:  # the others wait in a collective for the rank that failed
                    raise _explained(failure, self._label, failed_rank, what)
                raise RemoteTimeoutError(
                    f"{self._label} ranks {ranks} did not finish {what!r} within {timeout:g}s ({key}); group torn down"
                )
        if failure is not None:
            raise _explained(failure, self._label, failed_rank, what)
        return [results[r] for r in sorted(results)]

    def _died(self, rank: int, exc: RayActorError) -> str:
        """How every loss of a rank of this group is named: `rank r (group, pid, node address, node id) died`."""
        node = f", node id {self.node_ids[rank][:12]}" if rank < len(self.node_ids) else ""
        return f"rank {rank} ({self._label}, {death_site(exc)}{node}) died"

    def _dead_rank(self) -> str | None:
        """A rank of this group found dead by a call still in flight on it (another group's collective peer), named
        as a WorkerDiedError names it; None if none."""
        done = (
            ray.wait(list(self._in_flight), num_returns=len(self._in_flight), timeout=0)[0] if self._in_flight else []
        )
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                return self._died(self._in_flight[ref], exc)
            except Exception:  # noqa: BLE001, S112 - a Python error of that rank: not a death
                continue
        return None

    def _teardown(self, graceful: bool) -> None:
        """Stop every actor and free the placement group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if graceful and self._in_flight:  # a call still runs (its caller gave up): a teardown would queue behind it
            graceful = not ray.wait(list(self._in_flight), num_returns=len(self._in_flight), timeout=0)[1]
        self._in_flight.clear()
        try:
            if graceful and self._actors:
                ray.wait([a.teardown.remote() for a in self._actors], num_returns=len(self._actors), timeout=30)
        finally:
            for actor in self._actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001, S110 - already gone
                    pass
            self._actors = []
            if self._pg is not None:
                try:
                    remove_placement_group(self._pg)
                except Exception:  # noqa: BLE001, S110 - already removed
                    pass
                self._pg = None


_GROUPS: weakref.WeakSet[RayWorkerGroup[Any]] = weakref.WeakSet()  # this driver's groups: where a lost node is sought


def _peer_loss(failure: BaseException, label: str, rank: int, what: str) -> WorkerDiedError | None:
    """The one line of a peer-lost error of `label` rank `rank`: a rank of this driver's groups found dead by a call
    in flight on it, or placed on a node Ray reports dead; None when neither is known (yet)."""
    for group in list(_GROUPS):
        found = group._dead_rank() if not group._closed else None
        if found is not None:
            return caused_by(failure, f"{found}: {label} rank {rank} lost its peer during {what!r}")
    dead = {n["NodeID"]: str(n.get("NodeManagerAddress", "?")) for n in ray.nodes() if not n.get("Alive")}
    placements = [(group._label, group.node_ids) for group in list(_GROUPS)]
    return node_loss_error(failure, f"{label} rank {rank}", what, placements, dead)


def _explained(failure: BaseException, label: str, rank: int, what: str) -> BaseException:
    """A rank's error as the one line of the loss behind it when it says a peer is gone (a rank of this group, or of
    another group of this driver sharing the collective, that died or whose node died); else the error itself.

    Ray may take a while to call a node dead (`PEER_LOSS_WAIT_S`); an error that names no lost peer is not
    delayed."""
    if not says_peer_lost(failure):
        return failure
    give_up = time.monotonic() + PEER_LOSS_WAIT_S
    while (lost := _peer_loss(failure, label, rank, what)) is None:
        if time.monotonic() > give_up:  # one line all the same, never the transport's traceback
            return unnamed_peer_loss(failure, f"rank {rank} ({label})", what, PEER_LOSS_WAIT_S) or failure
        time.sleep(0.5)
    return lost

"""The Ray executor: one Ray actor per data-parallel rank, behind the same `WorkerGroup` API as the local one.

Layout: a placement group with one bundle per rank (`{"CPU": cpus_per_worker, "GPU": gpus_per_worker}`, PACK)
reserves the resources up front, so a group either starts whole or fails with a clear message instead of leaving
half its ranks waiting. Each actor hosts exactly one worker (`worker_cls(rank=r, comm=<collective>, **kwargs)`);
the collective is a `TorchDistCollective` (gloo on CPU, nccl on CUDA) rendezvousing through the env vars the
group sets (RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT, and RELAYRL_NODE_ID, the Ray node
id). A group given `node_ids` has no placement group: rank r is pinned to node `node_ids[r]` (colocated generation
workers next to their training ranks).

Failure model: a rank whose process dies (OOM kill, `ray.kill`, node loss) makes every call fail within seconds
with `WorkerDiedError("rank r died ...")`; the survivors are usually blocked inside a collective waiting for the
dead peer, so the whole group is torn down (a data-parallel group cannot continue without a rank). A Python error
on one rank is re-raised as is; if the other ranks do not finish within `error_grace_s` they are stuck in a
collective and the group is torn down too.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray
import ray.cloudpickle as cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relayrl.config import ClusterConfig
from relayrl.distributed.errors import RemoteTimeoutError, WorkerDiedError
from relayrl.distributed.interfaces import method_name
from relayrl.distributed.ray_nodes import NODE_ID_ENV, on_node
from relayrl.distributed.refit import private_ipc_dir

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")

# Driver env vars forwarded to every rank (a joined cluster's workers do not inherit the driver's environment).
_FORWARDED_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "TOKENIZERS_", "RELAYRL_", "CUBLAS_", "NCCL_", "GLOO_", "TORCH_")


def ensure_ray(cluster: ClusterConfig) -> bool:
    """Join a cluster or start a local Ray sized for the group; True if this call initialised Ray.

    A Ray that is already initialised is used as it is. `cluster.ray_address`, else the `RAY_ADDRESS` environment
    variable (what `ray job submit` sets for a job's driver), is joined as it is: its size is the cluster's, so no
    CPU count is passed, and it uses whatever authentication it asks for. Without either, a new local Ray is always
    started (`address="local"`), even where `ray start` left one running: max(4, ranks x cpus_per_worker) logical
    CPUs (Ray only uses them for placement), no dashboard, token authentication on (see `_token_for_local_ray`).
    """
    if ray.is_initialized():
        return False
    address = cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return True
    _token_for_local_ray()
    needed = cluster.num_nodes * cluster.workers_per_node * cluster.cpus_per_worker
    quiet = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "token authentication is enabled" notice, on every run
    try:
        ray.init(address="local", num_cpus=max(4, needed), include_dashboard=False)
    finally:
        quiet.setLevel(level)
    return True


def _token_for_local_ray() -> None:
    """Keep Ray's token authentication on for the local cluster relayrl starts (its GCS listens on the node's
    address: without a token anyone who can reach the port could run code as this user).

    Ray turns it on by default for a new local cluster, but would write the token to ~/.ray/auth_token; a fresh
    random token for this run in RAY_AUTH_TOKEN (inherited by Ray's processes, which read it before any file)
    keeps the home directory untouched. An explicit RAY_AUTH_MODE (e.g. `disabled`) or a token the user gave
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) is respected.
    """
    if "RAY_AUTH_MODE" in os.environ or "RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ:
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def _check_nodes_fit(num_nodes: int, node_bundle: dict[str, float]) -> None:
    """cluster.num_nodes > 1 places one bundle per node on distinct nodes: say so at once when the cluster has fewer
    nodes that can hold one, instead of waiting for a placement group that can never be ready."""
    fit = [
        n
        for n in ray.nodes()
        if n.get("Alive") and all(n.get("Resources", {}).get(res, 0.0) >= amount for res, amount in node_bundle.items())
    ]
    if len(fit) < num_nodes:
        raise ValueError(
            f"cluster.num_nodes={num_nodes} places {node_bundle} on each of {num_nodes} distinct nodes, but the Ray "
            f"cluster has {len(fit)} node(s) with that much: lower cluster.num_nodes or join a larger cluster"
        )


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

    # ------------------------------------------------------------------ start-up
    def _start(self, worker_cls: Any, cluster: ClusterConfig, timeout: float, init_kwargs: dict[str, Any]) -> None:
        bundle: dict[str, float] = {"CPU": float(cluster.cpus_per_worker)}
        if cluster.gpus_per_worker > 0:
            bundle["GPU"] = float(cluster.gpus_per_worker)
        total = ray.cluster_resources()
        for res, amount in bundle.items():
            if total.get(res, 0.0) < amount * self._world:
                raise ValueError(
                    f"cluster: {self._world} workers x {amount:g} {res} need {amount * self._world:g} {res} but the "
                    f"Ray cluster has {total.get(res, 0.0):g} in total"
                )
        # one node: a bundle per rank, packed; several: a bundle per node (its workers_per_node ranks) on distinct
        # nodes, so that num_nodes means nodes and NODE_RANK/LOCAL_RANK follow from the placement; `node_ids`:
        # rank r on node node_ids[r] (colocated generation, next to its training rank), no placement group
        per_node = cluster.num_nodes > 1
        wpn = cluster.workers_per_node
        if self._pinned is not None:
            self._start_actors(cluster, None, per_node)
        else:
            self._reserve(bundle, cluster, timeout, per_node)
            self._start_actors(cluster, self._pg, per_node)
        infos = self._gather(
            [(r, a.node_info.remote()) for r, a in enumerate(self._actors)], "start-up", timeout, self._start_key
        )
        self.pids = [int(i["pid"]) for i in infos]
        self.node_ids = [str(i["node_id"]) for i in infos]
        nodes = list(dict.fromkeys(self.node_ids))  # node order of first appearance
        seen: dict[str, int] = {}
        payload = ray.put(cloudpickle.dumps((worker_cls, init_kwargs)))
        refs = []
        for r, (actor, info) in enumerate(zip(self._actors, infos)):
            local_rank = seen.get(info["node_id"], 0)
            seen[info["node_id"]] = local_rank + 1
            node_rank = nodes.index(info["node_id"])
            if per_node:  # from the placement: bundle r // workers_per_node is node r // workers_per_node
                local_rank, node_rank = r % wpn, r // wpn
            rank_env = {
                "LOCAL_RANK": str(local_rank),
                "NODE_RANK": str(node_rank),
                NODE_ID_ENV: str(info["node_id"]),  # what pairs a colocated generation worker with its rank
                "MASTER_ADDR": str(infos[0]["ip"]),
                "MASTER_PORT": str(infos[0]["port"]),
            }
            settings = (cluster.torch_num_threads, cluster.deterministic, cluster.retain_freed_memory)
            refs.append((r, actor.setup.remote(rank_env, payload, *settings)))
        self._gather(refs, "worker construction", timeout, self._start_key)

    def _reserve(self, bundle: dict[str, float], cluster: ClusterConfig, timeout: float, per_node: bool) -> None:
        """The placement group of the ranks: a bundle per rank (PACK), or per node on distinct nodes."""
        wpn = cluster.workers_per_node
        if per_node:
            node_bundle = {res: amount * wpn for res, amount in bundle.items()}
            _check_nodes_fit(cluster.num_nodes, node_bundle)
            bundles, strategy = [dict(node_bundle) for _ in range(cluster.num_nodes)], "STRICT_SPREAD"
        else:
            bundles, strategy = [dict(bundle) for _ in range(self._world)], "PACK"
        self._pg = placement_group(bundles, strategy=strategy, name=f"{self._name}-pg-{uuid.uuid4().hex[:8]}")
        self.placement_group_id = self._pg.id.hex()
        try:
            ray.get(self._pg.ready(), timeout=timeout)
        except GetTimeoutError as exc:
            raise RemoteTimeoutError(
                f"placement group of {self._world} x {bundle} not ready after {timeout:g}s ({self._start_key}); Ray has "
                f"{ray.available_resources()} available (other groups or actors may hold them)"
            ) from exc

    def _start_actors(self, cluster: ClusterConfig, pg: PlacementGroup | None, per_node: bool) -> None:
        """One actor per rank, in its placement group bundle, or pinned to its node (`node_ids`)."""
        wpn = cluster.workers_per_node
        private_ipc_dir()  # this run's refit sockets: the directory's path travels to every rank in the env
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}
        actor_cls = ray.remote(_RankHost)
        for r in range(self._world):
            if self._pinned is not None:
                strategy: Any = on_node(self._pinned[r])
            elif pg is not None:
                index = r // wpn if per_node else r
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
            else:
                raise RuntimeError("a Ray worker group needs node_ids or a placement group")
            self._actors.append(
                actor_cls.options(
                    num_cpus=cluster.cpus_per_worker,
                    num_gpus=cluster.gpus_per_worker,
                    max_restarts=0,
                    scheduling_strategy=strategy,
                ).remote(r, self._world, {**env, "RANK": str(r), "WORLD_SIZE": str(self._world)})
            )

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
        refs = [(r, a.call_common.remote(name, common)) for r, a in enumerate(actors)]
        return self._gather(refs, name, self._call_timeout_s, self._call_key)

    def run_sharded(
        self, method: Callable[Concatenate[W, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        name = method_name(method)
        actors = self._live_actors()
        if len(shards) != len(actors):
            raise ValueError(f"run_sharded got {len(shards)} shards for {len(actors)} workers")
        common = ray.put((args, kwargs))
        refs = [(r, a.call_sharded.remote(name, s, common)) for r, (a, s) in enumerate(zip(actors, shards))]
        return self._gather(refs, name, self._call_timeout_s, self._call_key)

    def run_all_async(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> PendingCall[R]:
        """Start `method` on every rank and return at once (e.g. to join a collective the driver also joins)."""
        name = method_name(method)
        actors = self._live_actors()
        common = ray.put((args, kwargs))
        return PendingCall(self, [(r, a.call_common.remote(name, common)) for r, a in enumerate(actors)], name)

    def run_rank0(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        name = method_name(method)
        actor = self._live_actors()[0]
        result: R = self._gather(
            [(0, actor.call.remote(name, args, kwargs))], name, self._call_timeout_s, self._call_key
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

    def _gather(self, refs: list[tuple[int, Any]], what: str, timeout: float | None, key: str = "") -> list[Any]:
        """Results in rank order; a dead rank or a stuck group ends the wait in bounded time (`timeout`, the config
        `key` it comes from named in the error)."""
        pending = {ref: r for r, ref in refs}
        results: dict[int, Any] = {}
        failure: BaseException | None = None
        start = time.monotonic()
        give_up = start + timeout if timeout is not None else None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self._poll_s)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as exc:
                    self._teardown(graceful=False)
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    where = f"{self._label}, {death_site(exc)}"
                    raise WorkerDiedError(f"rank {rank} ({where}) died during {what!r}: {reason}") from exc
                except Exception as exc:  # noqa: BLE001 - a Python error on that rank, re-raised below
                    if failure is None:
                        failure = exc
                        give_up = min(give_up or float("inf"), time.monotonic() + self._error_grace_s)
            if pending and give_up is not None and time.monotonic() > give_up:
                ranks = sorted(pending.values())
                self._teardown(graceful=False)
                if failure is not None:  # the others wait in a collective for the rank that failed
                    raise failure
                raise RemoteTimeoutError(
                    f"{self._label} ranks {ranks} did not finish {what!r} within {timeout:g}s ({key}); group torn down"
                )
        if failure is not None:
            raise failure
        return [results[r] for r in sorted(results)]

    def _teardown(self, graceful: bool) -> None:
        """Stop every actor and free the placement group (idempotent)."""
        if self._closed:
            return
        self._closed = True
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

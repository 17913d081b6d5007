"""Where a Ray worker group's ranks go: the Ray a run uses (joined or started), and the placement of its ranks.

One node (`num_nodes=1`): a placement group with one bundle per rank (`{"CPU": cpus_per_worker, "GPU": ...}`,
PACK) reserves the resources up front, so a group either starts whole or fails with a clear message instead of
leaving half its ranks waiting. Several nodes: one bundle per node (its `workers_per_node` ranks) on distinct nodes
(STRICT_SPREAD), so that `num_nodes` means nodes and NODE_RANK/LOCAL_RANK follow from the placement (packing
per-rank bundles put both ranks of two one-rank nodes on one node). A group pinned to given nodes (colocated
generation, next to its training ranks) has no placement group.
"""

from __future__ import annotations

import logging
import os
import secrets
import uuid
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relayrl.config import ClusterConfig
from relayrl.distributed.errors import RemoteTimeoutError
from relayrl.distributed.ray_nodes import on_node


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


def rank_bundle(cluster: ClusterConfig) -> dict[str, float]:
    """The resources of one rank."""
    bundle: dict[str, float] = {"CPU": float(cluster.cpus_per_worker)}
    if cluster.gpus_per_worker > 0:
        bundle["GPU"] = float(cluster.gpus_per_worker)
    return bundle


def check_cluster_fits(bundle: dict[str, float], world: int) -> None:
    """Refuse at once a group the whole cluster cannot hold."""
    total = ray.cluster_resources()
    for res, amount in bundle.items():
        if total.get(res, 0.0) < amount * world:
            raise ValueError(
                f"cluster: {world} workers x {amount:g} {res} need {amount * world:g} {res} but the Ray cluster has "
                f"{total.get(res, 0.0):g} in total"
            )


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


def reserve(cluster: ClusterConfig, name: str, timeout: float, timeout_key: str) -> PlacementGroup:
    """The ready placement group of a group's ranks: a bundle per rank (PACK), or per node on distinct nodes."""
    bundle = rank_bundle(cluster)
    world = cluster.num_nodes * cluster.workers_per_node
    if cluster.num_nodes > 1:
        node_bundle = {res: amount * cluster.workers_per_node for res, amount in bundle.items()}
        _check_nodes_fit(cluster.num_nodes, node_bundle)
        bundles, strategy = [dict(node_bundle) for _ in range(cluster.num_nodes)], "STRICT_SPREAD"
    else:
        bundles, strategy = [dict(bundle) for _ in range(world)], "PACK"
    pg = placement_group(bundles, strategy=strategy, name=f"{name}-pg-{uuid.uuid4().hex[:8]}")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except BaseException as exc:
        remove_placement_group(pg)  # never left reserved by a group that did not start
        if isinstance(exc, GetTimeoutError):
            raise RemoteTimeoutError(
                f"placement group of {world} x {bundle} not ready after {timeout:g}s ({timeout_key}); Ray has "
                f"{ray.available_resources()} available (other groups or actors may hold them)"
            ) from exc
        raise
    return pg


def rank_strategy(rank: int, cluster: ClusterConfig, pg: PlacementGroup | None, pinned: list[str] | None) -> Any:
    """The scheduling strategy of rank `rank`: its node (`pinned`), else its bundle of `pg`."""
    if pinned is not None:
        return on_node(pinned[rank])
    if pg is None:
        raise RuntimeError("a Ray worker group needs node_ids or a placement group")
    index = rank // cluster.workers_per_node if cluster.num_nodes > 1 else rank
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def node_and_local_rank(rank: int, cluster: ClusterConfig, node_ids: list[str]) -> tuple[int, int]:
    """(NODE_RANK, LOCAL_RANK) of `rank`: from the placement with several nodes (bundle r // workers_per_node is
    node r // workers_per_node), else from where Ray put the ranks (`node_ids`, in rank order)."""
    if cluster.num_nodes > 1:
        return rank // cluster.workers_per_node, rank % cluster.workers_per_node
    nodes = list(dict.fromkeys(node_ids))  # node order of first appearance
    return nodes.index(node_ids[rank]), node_ids[:rank].count(node_ids[rank])

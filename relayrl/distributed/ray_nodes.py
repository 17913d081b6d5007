"""Where a Ray run's pieces live, and what every node of the cluster must see before any model loads.

Pieces that talk to the driver all the time (the data-plane store, the rollout actor) are pinned to the driver's
node with a hard node affinity: a soft one let Ray put them on any node, so whether losing a node also lost the
store was left to chance. Colocated generation workers are pinned to their training rank's node (the executor's
`node_ids`), and paired with it by Ray node id (`NODE_ID_ENV`), which host names do not give on every cluster.

Policy rank 0 writes checkpoints on its own node while the driver publishes them on its own, so the run directory
must be on storage that every node shares; and every rank loads the model from `policy.model_name`. Both are
checked at start-up on every node of the cluster (any of them may host rank 0 or a generation worker) but the
driver's own: the driver writes a random token into the run directory and a task on each other node must read it
back, and must find each model path. A node that cannot is named in one line, before any model loads.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from relayrl.distributed.errors import RemoteTimeoutError
from relayrl.distributed.refit import NODE_ID_ENV

__all__ = ["NODE_ID_ENV", "absolute_local_path", "check_nodes_see", "on_driver_node", "on_node"]

_TOKEN_FILE = ".relayrl-shared-storage-check"


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Scheduling strategy of an actor that must run on the driver's node (never elsewhere)."""
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    """Scheduling strategy of an actor that must run on node `node_id` (a colocated generation worker)."""
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def _node_view(token_path: str, token: str, paths: Mapping[str, str]) -> dict[str, Any]:
    """Runs on one node: whether it reads the driver's token, and which of `paths` ({key: path}) it lacks."""
    try:
        with open(token_path, encoding="utf-8") as f:
            sees_run_dir = f.read() == token
    except OSError:
        sees_run_dir = False
    return {"run_dir": sees_run_dir, "missing": [key for key, path in paths.items() if not os.path.exists(path)]}


def _describe(node: Mapping[str, Any]) -> str:
    host = node.get("NodeManagerHostname") or "?"
    return f"Ray node {host} ({node.get('NodeManagerAddress', '?')}, node id {str(node.get('NodeID', '?'))[:12]})"


def check_nodes_see(run_dir: Path, paths: Mapping[str, str], timeout_s: float) -> None:
    """Refuse (ValueError, one line) a run whose run directory or model paths are not visible on every alive node.

    `paths`: {config key: absolute local path} that every rank reads (e.g. policy.model_name)."""
    # the driver's own node sees what the driver wrote (its workers share its files): no task there, so a
    # one-node run pays no probe process; a Ray Client driver is elsewhere, so every node is asked then
    own = None if ray.util.client.ray.is_connected() else ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeID") != own]
    if not nodes:
        return
    token = secrets.token_hex(16)
    token_path = run_dir / _TOKEN_FILE
    token_path.write_text(token, encoding="utf-8")
    try:
        probe = ray.remote(num_cpus=0, max_retries=0)(_node_view)
        refs = [
            probe.options(scheduling_strategy=on_node(n["NodeID"])).remote(str(token_path), token, dict(paths))
            for n in nodes
        ]
        try:
            views = ray.get(refs, timeout=timeout_s)
        except GetTimeoutError as exc:
            raise RemoteTimeoutError(
                f"the storage check on every Ray node did not answer within {timeout_s:g}s (cluster.start_timeout_s)"
            ) from exc
    finally:
        token_path.unlink(missing_ok=True)
    for node, view in zip(nodes, views):
        if not view["run_dir"]:
            raise ValueError(
                f"the run directory {run_dir} is not visible from {_describe(node)}: a Ray run needs its run directory "
                "on storage every node shares (policy rank 0 writes checkpoints there); put --run-dir on a shared "
                "filesystem"
            )
    for node, view in zip(nodes, views):
        for key in view["missing"]:
            raise ValueError(
                f"{key} {paths[key]} does not exist on {_describe(node)}: every node loads it from that path; copy it "
                "there or put it on storage every node shares"
            )


def absolute_local_path(name: str) -> str:
    """`name` made absolute when it is a local path relative to the driver's working directory (it would resolve
    against each actor's own working directory otherwise); `builtin:` names and Hub ids are left as they are."""
    if name.startswith("builtin:") or os.path.isabs(name):
        return name
    path = Path(name).expanduser()
    return str(path.absolute()) if path.exists() else name

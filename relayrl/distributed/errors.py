"""Errors of the distributed layer, importable without Ray (the CLI catches them on any executor)."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence

from relayrl.utils.deadlines import DeadlineError

# A rank's error that says a peer of its collective is gone (gloo, sockets, NCCL).
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited")


class WorkerDiedError(RuntimeError):
    """A rank's process is gone; the message names the rank. The group is unusable afterwards."""


class RemoteTimeoutError(DeadlineError):
    """A wait on another process ran past its deadline; the message names what was waited for and the config key
    of the deadline. The run cannot continue (the group or actor is torn down)."""


class ActorLostError(RuntimeError):
    """A Ray actor of the run (the rollout actor, the asynchronous producer) died; the message names it and the call
    that found out. The run cannot continue; it resumes from its last checkpoint."""


def caused_by(failure: BaseException, line: str) -> WorkerDiedError:
    """The one line of a rank's loss, chained to the rank's own error (`failure`) that revealed it."""
    lost = WorkerDiedError(line)
    lost.__cause__ = failure
    return lost


def says_peer_lost(failure: BaseException) -> bool:
    """Whether a rank's error says a peer of its collective is gone (a lost node is worth looking for)."""
    return _PEER_LOST.search(str(failure)) is not None


def node_loss_error(
    failure: BaseException,
    failed: str,
    what: str,
    placements: Iterable[tuple[str, Sequence[str]]],
    dead: Mapping[str, str],
) -> WorkerDiedError | None:
    """A rank's peer-lost error (`failed`: "<group> rank r", during call `what`) as the one line of the node loss
    behind it: the first rank of `placements` ((group label, node id of each rank)) on a node of `dead` ({node id:
    address}); None when the error says no peer is gone or no rank ran on a dead node."""
    cause = _PEER_LOST.search(str(failure))
    if cause is None:
        return None
    for label, node_ids in placements:
        for rank, node_id in enumerate(node_ids):
            if node_id in dead:
                where = f"{label}, node {dead[node_id]}, node id {node_id[:12]}"
                return caused_by(
                    failure,
                    f"rank {rank} ({where}) died with its Ray node: {failed} lost its peer during {what!r} "
                    f"({cause.group(0)})",
                )
    return None


def unnamed_peer_loss(failure: BaseException, failed: str, what: str, waited_s: float) -> WorkerDiedError | None:
    """A rank's peer-lost error when no lost rank or node could be named within `waited_s`: still one line (which
    rank saw it, during which call, the transport's words), not the transport's traceback; None when the error says
    no peer is gone."""
    cause = _PEER_LOST.search(str(failure))
    if cause is None:
        return None
    return caused_by(
        failure,
        f"{failed} lost its peer during {what!r} ({cause.group(0)}): a rank, or the node of one, died and Ray "
        f"named neither within {waited_s:g}s",
    )


def leave_ray_quietly(timeout_s: float = 10.0) -> None:
    """Disconnect this driver from Ray before a failed run prints its one line, so that nothing Ray streams from the
    cluster afterwards (the raylets' own log lines about the loss, printed while the process exits) lands below it.
    Only where this process already uses Ray (nothing is imported); bounded, as a broken cluster may not answer;
    a failure to disconnect is ignored: the line is what matters."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return

    def shutdown() -> None:
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 - best effort on a cluster that just lost a node
            pass

    worker = threading.Thread(target=shutdown, name="relayrl-leave-ray", daemon=True)
    worker.start()
    worker.join(timeout_s)

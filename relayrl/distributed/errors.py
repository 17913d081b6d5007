"""Errors of the distributed layer, importable without Ray (the CLI catches them on any executor)."""

from __future__ import annotations

from relayrl.utils.deadlines import DeadlineError


class WorkerDiedError(RuntimeError):
    """A rank's process is gone; the message names the rank. The group is unusable afterwards."""


class RemoteTimeoutError(DeadlineError):
    """A wait on another process ran past its deadline; the message names what was waited for and the config key
    of the deadline. The run cannot continue (the group or actor is torn down)."""


class ActorLostError(RuntimeError):
    """A Ray actor of the run (the rollout actor, the asynchronous producer) died; the message names it and the call
    that found out. The run cannot continue; it resumes from its last checkpoint."""

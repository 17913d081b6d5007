"""Errors of the distributed layer, importable without Ray (the CLI catches them on any executor)."""

from __future__ import annotations


class WorkerDiedError(RuntimeError):
    """A rank's process is gone; the message names the rank. The group is unusable afterwards."""

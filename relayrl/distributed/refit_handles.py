"""Handles to the colocated refit's two ping-pong buffers, so a generation worker on the same node reads the
training rank's buffer in place instead of receiving its bytes through the ZMQ socket.

One code path; the device of the weights decides the kind of handle:

* `cuda_ipc`: the buffers live on the training rank's GPU; the handle is what
  `torch.multiprocessing.reductions.reduce_tensor` makes of them (a CUDA IPC memory handle), and the receiver, on the
  same GPU (colocated workers pair by GPU UUID), opens it on its own current device.
* `shm`: the buffers are files in /dev/shm (mode 0600) mapped `MAP_SHARED` by both sides
  (`torch.from_file(shared=True)`); the handle is the files' paths and size. Once the receiver mapped them the files
  are unlinked (both mappings stay), so a killed process leaves nothing behind.

The sender makes its buffers once per socket address and size and refills them in place on every refit; the receiver
maps a handle once and keeps the mapping. Where handles cannot be used (no /dev/shm, a receiver that cannot map them)
the refit falls back to the socket copy, logged once per address and reason.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

logger = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"


@dataclass
class SharedBuffers:
    """A training rank's two refit buffers [half] (uint8) and the kind of handle that shares them."""

    kind: str  # "cuda_ipc" | "shm"
    tensors: list[torch.Tensor]
    paths: list[str]  # shm: the files behind the buffers (unlinked once the receiver mapped them)
    mapped: bool = False  # a receiver mapped them
    _handles: dict[str, Any] | None = None

    def handles(self) -> dict[str, Any]:
        """What the receiver maps (picklable; made once)."""
        if self._handles is None:
            if self.kind == "shm":
                self._handles = {"kind": "shm", "paths": self.paths, "size": int(self.tensors[0].numel())}
            else:
                self._handles = {"kind": "cuda_ipc", "reduced": [reduce_tensor(t)[1] for t in self.tensors]}
        return self._handles


_senders: dict[tuple[str, str, int], SharedBuffers | None] = {}  # (address, device, size) -> buffers (None: refused)
_mapped: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # handle identity -> the receiver's views of the buffers
_logged: set[tuple[str, str]] = set()


def _log_once(address: str, line: str) -> None:
    if (address, line) not in _logged:
        _logged.add((address, line))
        logger.info("refit to %s: %s", address, line)


def _make(device: torch.device, size: int) -> SharedBuffers:
    if device.type == "cuda":
        return SharedBuffers("cuda_ipc", [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)], [])
    if device.type != "cpu":
        raise RuntimeError(f"no shareable buffer on a {device.type} device")
    if not os.path.isdir(SHM_ROOT) or not os.access(SHM_ROOT, os.W_OK):
        raise RuntimeError(f"{SHM_ROOT} is not a writable directory")
    paths = []
    for _ in range(2):
        fd, path = tempfile.mkstemp(prefix="relayrl-refit-", dir=SHM_ROOT)  # mode 0600
        os.close(fd)
        atexit.register(_unlink, path)
        paths.append(path)
    return SharedBuffers("shm", [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in paths], paths)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sender_buffers(address: str, device: torch.device, size: int) -> SharedBuffers | None:
    """This training rank's shared buffers for `address` (made on first use, then reused); None: the socket copy
    (the reason logged once)."""
    key = (address, str(device), size)
    if key not in _senders:
        try:
            _senders[key] = _make(device, size)
        except (RuntimeError, OSError) as exc:
            _senders[key] = None
            _log_once(address, f"socket copy (no shared buffer: {exc})")
    return _senders[key]


def accepted(buffers: SharedBuffers) -> None:
    """The receiver mapped `buffers`: their files are unlinked (the mappings stay), so nothing is left in /dev/shm
    when a process is killed without running its exit handlers."""
    for path in buffers.paths:
        _unlink(path)
    buffers.mapped = True


def refused(address: str, buffers: SharedBuffers, reason: str) -> None:
    """The receiver could not map `buffers`: socket copies from now on for this address (logged once); buffers
    another receiver mapped before (their files gone) are made afresh for the next refit instead."""
    for key, value in list(_senders.items()):
        if value is buffers:
            if buffers.mapped:
                del _senders[key]
            else:
                _senders[key] = None
    _log_once(address, f"socket copy (the generation worker cannot map {buffers.kind} handles: {reason})")


def chosen(address: str, kind: str) -> None:
    """Log the transport a refit to `address` used, once."""
    _log_once(address, f"{kind} handles (the receiver reads the training rank's buffer in place)")


def map_buffers(handles: dict[str, Any]) -> list[torch.Tensor]:
    """The receiver's views of the sender's buffers (mapped on first sight of these handles, then kept)."""
    if handles["kind"] == "shm":
        key: tuple[Any, ...] = ("shm", *handles["paths"], handles["size"])
        if key not in _mapped:
            size = handles["size"]
            for path in handles["paths"]:  # from_file would make a missing file: zeros instead of the weights
                if not os.path.isfile(path) or os.path.getsize(path) != size:
                    raise FileNotFoundError(f"{path} is not the sender's {size}-byte buffer")
            _mapped[key] = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in handles["paths"]]
        return _mapped[key]
    if handles["kind"] != "cuda_ipc":
        raise ValueError(f"unknown refit handle kind {handles['kind']!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA IPC handles offered to a process without CUDA")
    key = ("cuda_ipc", *(bytes(r[7]) for r in handles["reduced"]))  # the storages' IPC memory handles
    if key not in _mapped:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        views = []
        for args in handles["reduced"]:
            args = list(args)
            args[6] = torch.cuda.current_device()  # the same GPU, under this process's device numbering
            views.append(rebuild_cuda_tensor(*args))
        _mapped[key] = views
    return _mapped[key]


def written(buffer: torch.Tensor) -> None:
    """The sender filled `buffer`: on a GPU its copies must finish before the receiver reads it."""
    if buffer.device.type == "cuda":
        torch.cuda.current_stream(buffer.device).synchronize()


def read(buffer: torch.Tensor) -> None:
    """The receiver is done with `buffer` (its copies finished) before it ACKs and the sender refills it."""
    if buffer.device.type == "cuda":
        torch.cuda.current_stream(buffer.device).synchronize()

"""Handles to the colocated refit's two ping-pong buffers, so a generation worker on the same node reads the
training rank's buffer in place instead of receiving its bytes through the ZMQ socket.

One code path; the device of the weights decides the kind of handle:

* `cuda_ipc`: the buffers live on the training rank's GPU; the handle is what
  `torch.multiprocessing.reductions.reduce_tensor` makes of them (a CUDA IPC memory handle), and the receiver, on the
  same GPU (colocated workers pair by GPU UUID), opens it on its own current device.
* `shm`: the buffers are files in /dev/shm (a private directory, mode 0700) mapped `MAP_SHARED` by both sides
  (`torch.from_file(shared=True)`); the handle is the file's path and size.

The sender makes its buffers once per socket address and size and refills them in place on every refit; the receiver
maps a handle once and keeps the mapping. Where handles cannot be used (no /dev/shm, a receiver that cannot map them)
the refit falls back to the socket copy, logged once per address and reason.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
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
    paths: list[str]  # shm: the files behind the buffers
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
_shm_dir: list[str] = []


def _log_once(address: str, line: str) -> None:
    if (address, line) not in _logged:
        _logged.add((address, line))
        logger.info("refit to %s: %s", address, line)


def _private_shm_dir() -> str:
    if not _shm_dir:
        path = tempfile.mkdtemp(prefix="relayrl-refit-", dir=SHM_ROOT)  # mode 0700
        atexit.register(shutil.rmtree, path, True)
        _shm_dir.append(path)
    return _shm_dir[0]


def _make(device: torch.device, size: int) -> SharedBuffers:
    if device.type == "cuda":
        return SharedBuffers("cuda_ipc", [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)], [])
    if device.type != "cpu":
        raise RuntimeError(f"no shareable buffer on a {device.type} device")
    if not os.path.isdir(SHM_ROOT) or not os.access(SHM_ROOT, os.W_OK):
        raise RuntimeError(f"{SHM_ROOT} is not a writable directory")
    root = _private_shm_dir()
    paths = []
    for _ in range(2):
        fd, path = tempfile.mkstemp(prefix="buffer-", dir=root)
        os.close(fd)
        paths.append(path)
    return SharedBuffers("shm", [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in paths], paths)


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


def refused(address: str, buffers: SharedBuffers, reason: str) -> None:
    """The receiver could not map `buffers`: socket copies from now on for this address (logged once)."""
    for key, value in _senders.items():
        if value is buffers:
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

"""`Collective` over a torch.distributed process group: what data-parallel workers in separate processes use.

Each Ray rank (or any process started with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment)
builds one of these; the worker code that sums gradients and counts through `self.comm` then runs unchanged.
Backend: gloo for CPU tensors, nccl when the ranks compute on CUDA. Under nccl a CPU tensor (e.g. the initial
weight broadcast, made before the model moves to the GPU) is staged through the rank's GPU and copied back, so
callers never need to care which backend is underneath.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from relayrl.utils import deadlines

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT")


def default_backend(device: torch.device | str | None = None) -> str:
    """nccl when ranks compute on CUDA, gloo otherwise (CPU, or a CUDA build used on the CPU)."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def is_backend_timeout(exc: BaseException) -> bool:
    """Whether a torch.distributed error is its backend's own timeout (gloo: "Timed out waiting ...ms")."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


class TorchDistCollective:
    """One rank of a torch.distributed default process group, exposed through the `Collective` protocol."""

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        backend: str | None = None,
        init_method: str = "env://",
        timeout_s: float | None = None,
    ) -> None:
        """`timeout_s`: every collective's deadline (None: `cluster.collective_timeout_s`, as configured)."""
        rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None and "WORLD_SIZE" in os.environ else world_size
        if rank is None or world_size is None:
            raise ValueError("TorchDistCollective needs rank and world_size (arguments or RANK / WORLD_SIZE env vars)")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"TorchDistCollective: rank {rank} is not in a world of size {world_size}")
        if init_method == "env://":
            missing = [k for k in _ENV_KEYS if not os.environ.get(k)]
            if missing:
                raise ValueError(f"TorchDistCollective: env:// rendezvous needs the environment variable(s) {missing}")
        if dist.is_initialized():
            raise RuntimeError("TorchDistCollective: this process already has a torch.distributed default group")
        self._backend = backend or default_backend()
        if self._backend not in ("gloo", "nccl"):
            raise ValueError(f"TorchDistCollective: backend must be 'gloo' or 'nccl', got {self._backend!r}")
        if self._backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("TorchDistCollective: backend 'nccl' needs a CUDA device but torch sees none")
        if self._backend == "nccl":  # under Ray each rank sees only its own GPU(s): LOCAL_RANK picks among them
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        limit = deadlines.deadline("collective")
        self._deadline = limit if timeout_s is None else deadlines.Deadline(timeout_s, "timeout_s")
        self._rank = rank
        with self._bounded("joining the process group"):
            dist.init_process_group(
                self._backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=self._deadline.seconds),
            )
        self._world_size = world_size
        self._alive = True

    # ------------------------------------------------------------------ Collective protocol
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def deadline(self) -> deadlines.Deadline:
        """The group's timeout and the key that set it (DDP/FSDP2 collectives run under it too)."""
        return self._deadline

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._check_alive()
        work = self._staged(tensor)
        with self._bounded("all_reduce_sum"):
            dist.all_reduce(work, op=dist.ReduceOp.SUM)
        if work is not tensor:
            tensor.copy_(work)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._check_alive()
        if not 0 <= src < self._world_size:
            raise ValueError(f"broadcast source rank {src} does not exist in a group of {self._world_size}")
        work = self._staged(tensor)
        with self._bounded(f"broadcast from rank {src}"):
            dist.broadcast(work, src=src)
        if work is not tensor:
            tensor.copy_(work)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._check_alive()
        out: list[Any] = [None] * self._world_size
        with self._bounded("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Block until every rank reaches this point."""
        self._check_alive()
        with self._bounded("barrier"):
            dist.barrier()

    def destroy(self) -> None:
        """Tear the process group down (idempotent); the collective is unusable afterwards."""
        if self._alive and dist.is_initialized():
            dist.destroy_process_group()
        self._alive = False

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _bounded(self, op: str) -> Iterator[None]:
        """The backend's own timeout (the group's, set from the deadline) as one `DeadlineError` line naming the
        operation and this rank; other errors pass unchanged."""
        try:
            yield
        except RuntimeError as exc:
            if not is_backend_timeout(exc):
                raise
            what = f"rank {self._rank} of {self._world_size}: torch.distributed {self._backend} {op}"
            raise self._deadline.error(what) from exc

    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError(f"rank {self._rank}: the torch.distributed group has been destroyed")

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor the backend can work on in place: itself, or a contiguous (GPU, for nccl) copy."""
        if self._backend == "nccl" and tensor.device.type != "cuda":
            return tensor.detach().to(torch.device("cuda", torch.cuda.current_device())).contiguous()
        if not tensor.is_contiguous():
            return tensor.detach().contiguous()
        return tensor

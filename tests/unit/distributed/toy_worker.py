"""The collective calls the executor tests' toy workers share (test_local, test_ray_executor)."""

from __future__ import annotations

from typing import Any

import torch

from relayrl.distributed.interfaces import Collective


class CollectiveToyWorker:
    """A worker of `rank` holding a rank-dependent tensor `value` (set by the subclass): its sum over the ranks, the
    value of rank `src`, and every rank's object, through `comm`."""

    rank: int
    comm: Collective
    value: torch.Tensor

    def total(self) -> torch.Tensor:
        t = self.value.clone()
        self.comm.all_reduce_sum(t)
        return t

    def take_from(self, src: int) -> torch.Tensor:
        t = self.value.clone()
        self.comm.broadcast(t, src=src)
        return t

    def gather(self, obj: Any) -> list[Any]:
        return self.comm.all_gather_object((self.rank, obj))

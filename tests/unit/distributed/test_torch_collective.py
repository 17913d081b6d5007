"""TorchDistCollective's deadline (issue 28 item 5): in a real gloo group of 2 processes where rank 1 never joins
the collective, rank 0's all_reduce ends at `cluster.collective_timeout_s` with one line naming the operation, the
rank and the key."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from relayrl.distributed.torch_collective import TorchDistCollective
from relayrl.utils.deadlines import DeadlineError
from tests.helpers import tight_deadlines

#: Rank 1: joins the group (its own, long deadline), says so, then never calls a collective.
RANK1 = """
import datetime, sys, time
import torch.distributed as dist
print("imported", flush=True)
dist.init_process_group("gloo", init_method=sys.argv[1], rank=1, world_size=2, timeout=datetime.timedelta(seconds=60))
print("joined", flush=True)
time.sleep(60)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_that_never_joins_the_collective_ends_it_with_one_line(monkeypatch) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    peer = subprocess.Popen([sys.executable, "-c", RANK1, address], stdout=subprocess.PIPE, text=True)
    comm = None
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "imported"
        tight_deadlines(monkeypatch, collective_timeout_s=1.0)  # also the rendezvous' deadline
        comm = TorchDistCollective(0, 2, backend="gloo", init_method=address)
        assert peer.stdout.readline().strip() == "joined"
        start = time.monotonic()
        with pytest.raises(DeadlineError) as err:
            comm.all_reduce_sum(torch.ones(3))
        assert 1.0 <= time.monotonic() - start < 20
        assert str(err.value) == (
            "rank 0 of 2: torch.distributed gloo all_reduce_sum did not finish within 1s (cluster.collective_timeout_s)"
        )
    finally:
        peer.kill()
        peer.wait(30)
        if comm is not None:
            comm.destroy()
        assert not dist.is_initialized()

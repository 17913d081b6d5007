"""TorchDistCollective's deadline (issue 28 item 5): in a real gloo group of 2 processes where rank 1 never joins
the collective, rank 0's all_reduce ends at `cluster.collective_timeout_s` with one line naming the operation, the
rank and the key."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from relayrl.distributed.torch_collective import TorchDistCollective
from relayrl.utils.deadlines import DeadlineError
from tests.helpers import tight_deadlines

#: Rank 1: once told to (rank 0's store is up by then, so it connects at once instead of backing off), joins the
#: group with its own long deadline, says so, then never calls a collective.
RANK1 = """
import datetime, sys, time
import torch.distributed as dist
print("imported", flush=True)
sys.stdin.readline()
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
    peer = subprocess.Popen(
        [sys.executable, "-c", RANK1, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    built: list[TorchDistCollective] = []
    comm = None
    try:
        assert peer.stdin is not None and peer.stdout is not None
        assert peer.stdout.readline().strip() == "imported"
        tight_deadlines(monkeypatch, collective_timeout_s=1.0)  # also the rendezvous' deadline
        joining = threading.Thread(
            target=lambda: built.append(TorchDistCollective(0, 2, backend="gloo", init_method=address)), daemon=True
        )
        joining.start()  # rank 0 starts the store and waits for rank 1
        peer.stdin.write("go\n")
        peer.stdin.flush()
        joining.join(30)
        assert built, "rank 0 did not join the group"
        comm = built[0]
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

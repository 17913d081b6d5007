"""Collective deadlines (issue 28 item 5): in a real gloo group of 2 processes where rank 1 never joins the
collective, rank 0's call ends at `cluster.collective_timeout_s` with one line naming the operation, the rank and
the key: `TorchDistCollective.all_reduce_sum`, and DDP's gradient all-reduce inside backward (gloo's own text
otherwise: "Got the following error when running the callback: RuntimeError: [.../unbound_buffer.cc:78] Timed out
waiting 1000ms for recv operation to complete", several lines)."""

from __future__ import annotations

import importlib
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from relayrl.distributed.parallelize import wrap_model
from relayrl.distributed.torch_collective import TorchDistCollective
from relayrl.utils.deadlines import DeadlineError, deadline_line
from tests.helpers import tight_deadlines

#: Rank 1: once told to (rank 0's store is up by then, so it connects at once instead of backing off), joins the
#: group with its own long deadline, says so, then never calls a collective.
RANK1 = """
import datetime, sys, time
import torch.distributed as dist
if sys.argv[2] == "ddp":
    import torch._dynamo  # what DDP's constructor imports (seconds): paid here, while rank 0 pays its own
print("imported", flush=True)
sys.stdin.readline()
dist.init_process_group("gloo", init_method=sys.argv[1], rank=1, world_size=2, timeout=datetime.timedelta(seconds=60))
print("joined", flush=True)
if sys.argv[2] == "ddp":  # wraps the same model as rank 0 (DDP's construction is collective), then never trains
    import torch
    torch.manual_seed(0)
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1), broadcast_buffers=False)
    print("wrapped", flush=True)
time.sleep(60)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("path", ["collective", "ddp"])
def test_a_rank_that_never_joins_the_collective_ends_it_with_one_line(monkeypatch, path: str) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    peer = subprocess.Popen(
        [sys.executable, "-c", RANK1, address, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    built: list[TorchDistCollective] = []
    comm = None
    try:
        if path == "ddp":
            importlib.import_module("torch._dynamo")  # DDP's constructor imports it: paid while the peer starts
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
        if path == "collective":
            start = time.monotonic()
            with pytest.raises(DeadlineError) as err:
                comm.all_reduce_sum(torch.ones(3))
            what = "torch.distributed gloo all_reduce_sum"
        else:
            torch.manual_seed(0)
            dp = wrap_model(torch.nn.Linear(3, 1), "ddp", comm, torch.device("cpu"))  # comm hook: sums
            assert peer.stdout.readline().strip() == "wrapped"
            loss = dp.forward(lambda: dp.module(torch.ones(2, 3)).sum(), training=True)
            start = time.monotonic()
            with pytest.raises(DeadlineError) as err:
                dp.backward(loss)  # the last micro-batch's backward: DDP all-reduces the gradients in it
            what = "ddp gradient all-reduce in backward (gloo)"
        assert 1.0 <= time.monotonic() - start < 20
        assert str(err.value) == f"rank 0 of 2: {what} did not finish within 1s (cluster.collective_timeout_s)"
        assert deadline_line(err.value) == str(err.value)  # what the CLI prints, before the resume command
    finally:
        peer.kill()
        peer.wait(30)
        if comm is not None:
            comm.destroy()
        assert not dist.is_initialized()

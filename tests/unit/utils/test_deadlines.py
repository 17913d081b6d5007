"""relayrl.utils.deadlines: the configured deadlines reach every process through the environment, each helper ends
a real wait that never ends with one line naming it, the deadline and the key, and the CLI's line is found in a Ray
error's text."""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback

import pytest

from relayrl.config import ClusterConfig
from relayrl.distributed.errors import RemoteTimeoutError
from relayrl.utils import deadlines
from tests.helpers import tight_deadlines


def test_configure_publishes_the_keys_and_defaults_come_from_the_schema(monkeypatch) -> None:
    for kind in ("start", "call", "wait", "collective"):
        monkeypatch.delenv(f"RELAYRL_{kind.upper()}_TIMEOUT_S", raising=False)
    assert deadlines.deadline("wait") == deadlines.Deadline(1800.0, "cluster.wait_timeout_s")
    tight_deadlines(monkeypatch, collective_timeout_s=0.25, call_timeout_s=7)
    assert deadlines.deadline("collective") == deadlines.Deadline(0.25, "cluster.collective_timeout_s")
    assert deadlines.deadline("call") == deadlines.Deadline(7.0, "cluster.call_timeout_s")
    assert deadlines.deadline("start").seconds == ClusterConfig().start_timeout_s
    # a child process (a spawned generation process, a Ray rank) reads the same deadlines
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(deadlines.deadline, ("collective",)) == deadlines.Deadline(
            0.25, "cluster.collective_timeout_s"
        )


def test_each_helper_ends_a_wait_that_never_ends(monkeypatch) -> None:
    tight_deadlines(monkeypatch, wait_timeout_s=0.1, call_timeout_s=0.1)
    cond, lock, gate = threading.Condition(), threading.Lock(), threading.Event()
    with cond, pytest.raises(deadlines.DeadlineError) as err:
        deadlines.wait_for(cond, lambda: False, "batch 3 from the producer")
    assert str(err.value) == "batch 3 from the producer did not finish within 0.1s (cluster.wait_timeout_s)"
    stuck = threading.Thread(target=gate.wait, daemon=True)
    stuck.start()
    with pytest.raises(deadlines.DeadlineError, match=r"^joining the stuck thread did not finish within 0\.1s"):
        deadlines.join(stuck, "joining the stuck thread")
    with lock, pytest.raises(deadlines.DeadlineError, match=r"^the engine lock did not finish within 0\.1s \(cl"):
        with deadlines.held(lock, "the engine lock"):
            pass
    parent, child = multiprocessing.Pipe()  # a peer that never answers
    start = time.monotonic()
    with pytest.raises(deadlines.DeadlineError, match=r"^pid 7's reply did not finish within 0\.1s \(cluster\.call_"):
        deadlines.recv(parent, "pid 7's reply")
    assert 0.1 <= time.monotonic() - start < 2
    gate.set()
    child.send("late")
    assert deadlines.recv(parent, "a reply") == "late"  # an answer within the deadline passes through


def test_the_cli_line_is_found_in_a_remote_error() -> None:
    line = "PolicyWorker ranks [1] did not finish 'train' within 5s (cluster.call_timeout_s); group torn down"
    assert isinstance(RemoteTimeoutError(line), deadlines.DeadlineError)  # the CLI ends both alike
    exceptions = pytest.importorskip("ray.exceptions")
    rank_line = (
        "rank 1 of 2: torch.distributed gloo all_reduce_sum did not finish within 0.5s (cluster.collective_timeout_s)"
    )
    try:  # raised on a rank: the driver gets Ray's error, its text the actor's header and traceback
        raise deadlines.DeadlineError(rank_line)
    except deadlines.DeadlineError as exc:
        remote = exceptions.RayTaskError("call", traceback.format_exc(), exc).as_instanceof_cause()
    assert isinstance(remote, deadlines.DeadlineError) and str(remote).splitlines()[0] != rank_line
    assert deadlines.deadline_line(remote) == rank_line
    assert deadlines.deadline_line(RemoteTimeoutError(line)) == line

"""The contract suite on the `transfer_queue` backend, plus checks of the TQ behaviours the adapter compensates.

TransferQueue takes 10-40 s to start here (three actor processes importing torch), so one instance serves the
module; each check's client attaches to it after a `reset` (empty store, the capacity the check asked for).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import DataPlaneClient, FieldNotWrittenError, MissingKeysError
from tests.unit.data_plane.contract import CONTRACT_CHECKS, hosted_store_fixtures
from tests.unit.data_plane.contract_integrity import check_corrupted_row_fails_at_get, check_latency_percentiles

ray = pytest.importorskip("ray")
pytest.importorskip("transfer_queue")

pytestmark = pytest.mark.ray

CFG = DataPlaneConfig(enabled=True, backend="transfer_queue", storage_capacity=10_000, verify_checksums=True)


owner, make_client = hosted_store_fixtures("relayrl.data_plane.tq_adapter", CFG)


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__)
def test_tq_contract(check: Callable[[Callable[..., DataPlaneClient]], None], make_client: Callable) -> None:
    check(make_client)


def test_tq_silent_behaviours_are_compensated(make_client: Callable[..., DataPlaneClient]) -> None:
    """Each case below is one where bare TransferQueue answers silently and the adapter refuses or repairs."""
    import transfer_queue as tq

    c = make_client()
    c.register_partition("p", ["ids", "x", "y"], 3, ["t"])
    c.put_samples(["a", "b", "c"], "p", {"ids": Column(torch.arange(6), torch.tensor([1, 2, 3]))})
    # TQ alone returns 2 rows for 3 keys when one is missing.
    assert tq.kv_batch_get(["a", "zz", "c"], "p", ["ids"]).batch_size[0] == 2
    with pytest.raises(MissingKeysError):
        c.get_samples(["a", "zz", "c"], "p", ["ids"])
    # TQ alone returns an empty result for a field only some keys have.
    c.put_samples(["a"], "p", {"x": torch.tensor([1.0])})
    assert len(tq.kv_batch_get(["a", "b"], "p", ["x"]).keys()) == 0
    with pytest.raises(FieldNotWrittenError):
        c.get_samples(["a", "b"], "p", ["x"])
    # TQ alone returns every dense multi-dim field as a nested tensor; the adapter restores the dense column.
    grid = torch.arange(18).reshape(3, 2, 3)
    c.put_samples(["a", "b", "c"], "p", {"y": grid})
    got = c.get_samples(["c", "a"], "p", ["y"])["y"]
    assert not got.is_jagged and torch.equal(got.values, grid[[2, 0]])
    # A rejected put never reaches TQ (bare TQ keeps the keys of a put its storage rejected registered).
    with pytest.raises(Exception, match="first written"):
        c.put_samples(["new"], "p", {"x": torch.tensor([1])})
    assert "new" not in tq.kv_list("p").get("p", {})
    c.close()


def test_put_that_tq_reports_but_does_not_record_is_rolled_back(
    make_client: Callable[..., DataPlaneClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TQ logs, but does not raise, when its controller rejects or never acknowledges a put's update."""
    from relayrl.data_plane import tq_adapter

    c = make_client()
    c.register_partition("p", ["x"], 3, ["t"])
    c.put_samples(["a"], "p", {"x": torch.tensor([1.0])})

    async def reported_but_not_recorded(**_: object) -> None:
        return None

    monkeypatch.setattr(tq_adapter.tq, "async_kv_batch_put", reported_but_not_recorded)
    with pytest.raises(RuntimeError, match="recorded"):
        c.put_samples(["a", "b"], "p", {"x": torch.tensor([2.0, 3.0])})
    monkeypatch.undo()
    with pytest.raises(MissingKeysError):  # the new key was rolled back
        c.get_samples(["b"], "p", ["x"])
    with pytest.raises(FieldNotWrittenError):  # the overwritten key may hold a mix: refused, not guessed
        c.get_samples(["a"], "p", ["x"])
    c.put_samples(["a"], "p", {"x": torch.tensor([4.0])})
    assert c.get_samples(["a"], "p", ["x"])["x"].values.tolist() == [4.0]
    c.close()


def test_second_bootstrap_fails_clearly(owner: DataPlaneClient) -> None:
    from relayrl.data_plane.tq_adapter import build_client

    with pytest.raises(RuntimeError, match="already runs"):
        build_client(CFG, bootstrap=True)


def _corrupt_in_tq(client: DataPlaneClient, partition_id: str, key: str, field: str) -> None:
    """Write the row back to TransferQueue directly with one bit flipped: the ledger never hears of it."""
    import transfer_queue as tq
    from tensordict import TensorDict

    from relayrl.data_plane.tq_adapter import _to_wire
    from tests.unit.data_plane.contract_integrity import flip_first_bit

    col = client.get_samples([key], partition_id, [field])[field]
    values = col.values.clone()
    flip_first_bit(values)
    wire = _to_wire(Column(values, col.lengths))
    tq.kv_batch_put(keys=[key], partition_id=partition_id, fields=TensorDict({field: wire}, batch_size=[1]))


def test_tq_corrupted_row_fails_at_get(make_client: Callable[..., DataPlaneClient]) -> None:
    check_corrupted_row_fails_at_get(make_client, _corrupt_in_tq)


def test_tq_latency_percentiles(make_client: Callable[..., DataPlaneClient]) -> None:
    check_latency_percentiles(make_client)


def test_a_wedged_transfer_queue_ends_a_get_at_data_plane_call_timeout_s(
    make_client: Callable[..., DataPlaneClient],
) -> None:
    """Issue 28 item 5: TransferQueue's controller process stops answering (SIGSTOP: a real hang, not a mock); a
    get on it ends at data_plane.call_timeout_s with one line naming the call, the partition and the key (a
    `DeadlineError`: the CLI exits 1). Once the controller runs again the store answers as before. Last in the
    module: it pauses the module's shared TransferQueue."""
    import os
    import signal
    import time

    from relayrl.data_plane.remote import lookup_actor
    from relayrl.data_plane.tq_adapter import TQ_CONTROLLER_NAME, TQ_NAMESPACE, build_client
    from relayrl.utils.deadlines import DeadlineError

    c = make_client()
    c.register_partition("wedged", ["x"], 2, ["t"])
    c.put_samples(["a", "b"], "wedged", {"x": torch.tensor([1.0, 2.0])})
    fast = build_client(CFG.model_copy(update={"call_timeout_s": 0.5}), bootstrap=False)  # a worker's client
    controller = lookup_actor(TQ_CONTROLLER_NAME, TQ_NAMESPACE)
    assert controller is not None
    pid = ray.get(controller.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    os.kill(pid, signal.SIGSTOP)
    try:
        # kill() returns before the signal is delivered: until the kernel reports the controller stopped, it may
        # still answer (it polls its sockets without sleeping); one suite run's get came back with its rows
        stopped_by = time.monotonic() + 10
        while _process_state(pid) not in ("T", "t"):
            assert time.monotonic() < stopped_by, f"the controller (pid {pid}) never stopped: {_process_state(pid)}"
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(DeadlineError) as err:
            fast.get_samples(["a", "b"], "wedged", ["x"])
        assert time.monotonic() - start < 10
        assert str(err.value) == (
            "transfer_queue: get on partition 'wedged' did not finish within 0.5s (data_plane.call_timeout_s)"
        )
    finally:
        os.kill(pid, signal.SIGCONT)
        fast.close()
    assert c.get_samples(["a", "b"], "wedged", ["x"])["x"].values.tolist() == [1.0, 2.0]
    c.close()


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of a process (`T`: stopped by a signal), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]

"""Contract checks every backend runs for row checksums and latency percentiles (issue 28, item 3).

`check_corrupted_row_fails_at_get(make, corrupt)` needs the backend's own way of changing stored bytes behind the
client's back: `corrupt(client, partition_id, key, field)` flips one bit of that row's first element in the
store itself (`corrupt_columnar_store` for the memory and ray backends' `ColumnarStore`; the TQ module writes to
TransferQueue directly). `check_latency_percentiles(make)` is backend-agnostic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import ChecksumMismatchError, DataPlaneClient
from relayrl.data_plane.memory import ColumnarStore
from relayrl.data_plane.metrics import MeteredDataPlaneClient, merge_clients
from tests.unit.data_plane.contract import ClientFactory, _batch, _client, _register

Corrupter = Callable[[DataPlaneClient, str, str, str], None]


def flip_first_bit(t: torch.Tensor) -> None:
    """In place: flip bit 0 of the first byte of `t` (a contiguous tensor holding one row)."""
    t.reshape(-1)[:1].view(torch.uint8)[0] ^= 1


def corrupt_columnar_store(store: ColumnarStore, partition_id: str, key: str, field: str) -> None:
    """Flip one bit of `key`'s `field` inside a `ColumnarStore`'s packed segment (no client involved)."""
    row = store._parts[partition_id].rows[key]
    fs = store._columns[partition_id][field]
    seg, pos = fs.segments[int(fs.loc_seg[row])], int(fs.loc_pos[row])
    if seg.offsets is None:
        flip_first_bit(seg.values[pos])
    else:
        flip_first_bit(seg.values[int(seg.offsets[pos]) : int(seg.offsets[pos + 1])])


def check_corrupted_row_fails_at_get(make: ClientFactory, corrupt: Corrupter) -> None:
    """A row changed in the store fails the get that fetches it, with one line naming the key and the field; gets
    of other fields or other keys still pass (a partial get verifies what it fetches), and a field written later
    (a write-back) carries its own checksum."""
    with _client(make) as c:
        pid = _register(c, 4)
        keys, fields, lens = _batch(4, seed=11)
        c.put_samples(keys, pid, fields)
        prev = Column(torch.randn(int(lens.sum())), lens)
        c.put_samples(keys, pid, {"prev_logprobs": prev})  # the write-back
        assert torch.equal(c.get_samples(keys, pid, ["prev_logprobs"])["prev_logprobs"].values, prev.values)
        for field in ("logprobs", "prev_logprobs", "reward"):
            corrupt(c, pid, keys[2], field)
            with pytest.raises(ChecksumMismatchError) as e:
                c.get_samples(keys, pid, ["input_ids", field])
            msg = str(e.value)
            assert "\n" not in msg and repr(keys[2]) in msg and f"'{field}'" in msg, msg
            assert (e.value.key, e.value.field) == (keys[2], field)
            others = [k for k in keys if k != keys[2]]
            c.get_samples(others, pid, [field])  # the other rows of the field verify
            c.get_samples(keys, pid, ["input_ids", "token_mask"])  # the key's other fields verify


def _exact_quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def check_latency_percentiles(make: ClientFactory) -> None:
    """Each client reports p50/p90 per operation; merged across clients they are the percentiles of every call
    together (within the histogram's 2**(1/16) resolution), not an average of the clients' percentiles."""
    with _client(make) as inner:
        events: dict[str, list[dict[str, Any]]] = {"driver": [], "worker": []}
        driver = MeteredDataPlaneClient(inner, is_driver=True, on_event=events["driver"].append)
        worker = MeteredDataPlaneClient(inner, on_event=events["worker"].append)
        pid = _register(driver, 16)
        keys, fields, _ = _batch(16, seed=12)
        driver.put_samples(keys, pid, fields)
        for i in range(12):
            (driver if i % 3 == 0 else worker).get_samples(keys[i : i + 4], pid, ["input_ids", "reward"])
        parts = [driver.metrics(), worker.metrics()]
        for part in parts:
            assert part["data_plane/get/ms_p50"] <= part["data_plane/get/ms_p90"]
            assert part["data_plane/get/ms_p90"] <= part["data_plane/get/ms_max"] * 2 ** (1 / 16) + 1e-9
        merged = merge_clients(parts)
        gets = [e["wall_ms"] for ev in events.values() for e in ev if e["op"] == "get"]
        assert len(gets) == 12
        for q, name in ((0.5, "ms_p50"), (0.9, "ms_p90")):
            exact = _exact_quantile(gets, q)
            got = merged[f"data_plane/all/get/{name}"]
            assert abs(got / max(exact, 1e-3) - 1) <= 2 ** (1 / 16) - 1 + 1e-9 or exact <= 1e-3, (name, got, exact)
        assert merged["data_plane/all/get/ms_total"] == pytest.approx(sum(gets))
        all_ms = sum(e["wall_ms"] for ev in events.values() for e in ev)
        assert merged["data_plane/all/ms_total"] == pytest.approx(all_ms)

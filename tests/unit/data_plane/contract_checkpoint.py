"""Contract checks of `list_sample_ids` and the data-plane checkpoint (`save_checkpoint` / `load_checkpoint`).

Part of `contract.CONTRACT_CHECKS`, so every backend runs them. A check saves from one client, then loads into the
empty store of a second one (`make()`: a fresh store, or the hosted one reset) and compares everything a resumed run
can observe: key order, every field's rows and dtype, tags, claim cursors, schemas and the metadata.
"""

from __future__ import annotations

import json
import logging
import struct
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import DataPlaneClient, SchemaMismatchError, UnknownPartitionError
from relayrl.data_plane.snapshot import DamagedCheckpointError
from relayrl.utils.state_file import CheckpointError

ClientFactory = Callable[..., DataPlaneClient]
FIELDS = ["ids", "mask", "lp", "lp16", "reward", "grid", "prev_lp", "gone"]


def _pid() -> str:
    return f"ck-{uuid.uuid4().hex[:10]}"


def _fields(n: int, seed: int) -> dict[str, Column | torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 6, (n,), generator=g)  # [N], zero-length rows included
    t = int(lens.sum())
    return {
        "ids": Column(torch.randint(0, 50_000, (t,), generator=g), lens),
        "mask": Column(torch.rand(t, generator=g) > 0.5, lens),
        "lp": Column(-torch.rand(t, generator=g) * 5, lens),
        "lp16": Column((-torch.rand(t, generator=g) * 5).to(torch.bfloat16), lens),
        "reward": torch.randn(n, generator=g),
        "grid": torch.randint(-9, 9, (n, 2, 3), generator=g),
    }


def check_list_sample_ids_in_insertion_order(make: ClientFactory) -> None:
    c = make()
    try:
        pid = _pid()
        c.register_partition(pid, ["reward"], 4, ["t"])
        assert c.list_sample_ids(pid) == []
        c.put_samples(["c", "a", "b"], pid, {"reward": torch.zeros(3)})
        c.put_samples(["d", "a"], pid, {"reward": torch.ones(2)})  # "a" overwritten: keeps its place
        assert c.list_sample_ids(pid) == ["c", "a", "b", "d"]
        c.clear_samples(["a"], pid)
        assert c.list_sample_ids(pid) == ["c", "b", "d"]
        with pytest.raises(UnknownPartitionError):
            c.list_sample_ids("never-registered")
    finally:
        c.close()


def _observe(c: DataPlaneClient, pid: str, written: dict[str, list[str]]) -> dict[str, object]:
    """Everything about a partition a resumed run could see, without moving any cursor."""
    out: dict[str, object] = {"keys": c.list_sample_ids(pid)}
    for name, keys in written.items():
        col = c.get_samples(keys, pid, [name])[name]
        out[name] = (col.dtype, col.values.clone(), None if col.lengths is None else col.lengths.clone())
    return out


def _same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        if isinstance(x, tuple) and isinstance(y, tuple):
            assert x[0] == y[0], name
            assert x[1].dtype == y[1].dtype and torch.equal(x[1], y[1]), name
            assert (x[2] is None and y[2] is None) or torch.equal(x[2], y[2]), name
        else:
            assert x == y, name


def check_checkpoint_round_trip_exact(make: ClientFactory) -> None:
    pid, other = _pid(), _pid()
    keys = [f"u{i // 2}_g{i % 2}" for i in range(6)]
    written = {name: keys for name in _fields(1, 0)} | {"prev_lp": keys[1:4]}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "dp"
        src = make()
        try:
            src.register_partition(pid, FIELDS, 6, ["train", "ref"], grpo_group_size=2)
            src.register_partition(other, ["reward"], 1, ["t"])
            src.put_samples(keys, pid, _fields(6, 1), tags=[{"i": i, "w": 0.5 * i, "s": str(i)} for i in range(6)])
            src.put_samples(keys[1:4], pid, {"prev_lp": torch.randn(3, dtype=torch.float64)})
            src.put_samples(["x"], pid, {"gone": torch.tensor([1], dtype=torch.int32)})
            src.clear_samples(["x"], pid)  # "gone" keeps its schema with no rows
            claimed = src.claim_meta(pid, "train", ["ids"], 4, blocking=False)
            assert claimed.keys == keys[:4]
            before = _observe(src, pid, written)
            src.save_checkpoint(ckpt, metadata={"step": 3, "note": "x"})
            src.save_checkpoint(ckpt, metadata={"step": 4})  # replaces the previous one
        finally:
            src.close()
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["dp"]  # no temp or old directory left
        dst = make()
        try:
            assert dst.load_checkpoint(ckpt) == {"step": 4}
            _same(before, _observe(dst, pid, written))
            assert dst.list_sample_ids(other) == []
            rest = dst.claim_meta(pid, "train", ["ids"], 10, blocking=False)
            assert rest.keys == keys[4:] and rest.tags == [{"i": i, "w": 0.5 * i, "s": str(i)} for i in (4, 5)]
            assert dst.check_consumption_status(pid, ["train"]) and not dst.check_consumption_status(pid, ["ref"])
            assert dst.claim_meta(pid, "ref", ["prev_lp"], 10, blocking=False).keys == keys[1:4]
            with pytest.raises(SchemaMismatchError):
                dst.put_samples(["y"], pid, {"gone": torch.tensor([1.0])})
            with pytest.raises(ValueError, match="holds"):  # never loads over live samples
                dst.load_checkpoint(ckpt)
        finally:
            dst.close()


def check_checkpoint_version_is_checked(make: ClientFactory) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "dp"
        c = make()
        try:
            c.register_partition(_pid(), ["reward"], 1, ["t"])
            c.save_checkpoint(ckpt)
            manifest = json.loads((ckpt / "manifest.json").read_text())
            assert manifest["version"] == 2 and manifest["metadata"] == {}
            (ckpt / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
            with pytest.raises(CheckpointError, match="version 99 is not supported") as err:
                c.load_checkpoint(ckpt)
            assert "\n" not in str(err.value)
            with pytest.raises(CheckpointError, match="manifest"):
                c.load_checkpoint(Path(tmp) / "missing")
            with pytest.raises(TypeError, match="JSON"):
                c.save_checkpoint(Path(tmp) / "bad", metadata={"t": torch.zeros(1)})
        finally:
            c.close()


def flip_saved_bit(store_file: Path, partition_id: str, field: str, byte: int) -> None:
    """Flip bit 0 of byte `byte` of `field`'s saved values in `partition_id`, in the safetensors file itself (its
    header: 8-byte little-endian length, then JSON naming each tensor's byte range and the state tree)."""
    raw = bytearray(store_file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    tree = json.loads(header["__metadata__"]["tree"])
    part = next(p for p in tree["partitions"] if p["id"] == partition_id)
    start, end = header[part["columns"][field]["values"]["__tensor__"]]["data_offsets"]
    assert 0 <= byte < end - start
    raw[8 + n + start + byte] ^= 1
    store_file.write_bytes(bytes(raw))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def check_damaged_checkpoint_row_fails_at_load(make: ClientFactory) -> None:
    """A bit flipped on disk in one saved row fails the load with one line naming the file, partition, key and
    field, before any row enters the store; the same file labelled version 1 (no digests) loads unverified, with a
    one-line warning."""
    pid = _pid()
    keys = [f"k{i}" for i in range(5)]
    fields = _fields(5, 3)
    lp = fields["lp"]
    assert isinstance(lp, Column) and lp.lengths is not None
    i = int(torch.nonzero(lp.lengths)[-1])  # the last row with tokens: a row in the middle of the saved tensor
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "dp"
        src = make()
        try:
            src.register_partition(pid, FIELDS, 5, ["t"])
            src.put_samples(keys, pid, fields)
            src.save_checkpoint(ckpt)
        finally:
            src.close()
        store_file = ckpt / "store.safetensors"
        flip_saved_bit(store_file, pid, "lp", int(lp.lengths[:i].sum()) * lp.values.element_size())
        dst = make()
        try:
            with pytest.raises(DamagedCheckpointError) as err:  # a CheckpointError: the CLI refuses it, exit 2
                dst.load_checkpoint(ckpt)
            msg = str(err.value)
            assert "\n" not in msg and str(store_file) in msg and repr(pid) in msg, msg
            assert repr(keys[i]) in msg and "field 'lp'" in msg, msg
            assert (err.value.key, err.value.field) == (keys[i], "lp")
            with pytest.raises(UnknownPartitionError):  # verified before anything was registered or put
                dst.list_sample_ids(pid)
            manifest = json.loads((ckpt / "manifest.json").read_text())
            (ckpt / "manifest.json").write_text(json.dumps({**manifest, "version": 1}))
            records, log = _Records(), logging.getLogger("relayrl.data_plane.snapshot")
            log.addHandler(records)
            try:
                dst.load_checkpoint(ckpt)
            finally:
                log.removeHandler(records)
            assert len(records.lines) == 1 and "unverified" in records.lines[0] and str(store_file) in records.lines[0]
            got = dst.get_samples([keys[i]], pid, ["lp"])["lp"].values
            assert not torch.equal(got, lp.row(i))  # what "unverified" means: the damaged row was accepted
        finally:
            dst.close()


CHECKPOINT_CHECKS: list[Callable[[ClientFactory], None]] = [
    check_list_sample_ids_in_insertion_order,
    check_checkpoint_round_trip_exact,
    check_checkpoint_version_is_checked,
    check_damaged_checkpoint_row_fails_at_load,
]

"""Data-plane checkpoints: the whole store written to a directory and read back exactly, on every backend.

Why through the client API: the ledger's bookkeeping comes from `export_state` (one call, hosted or not) and the
tensors from ordinary `get_samples`, so memory, ray and transfer_queue share this one implementation and a
checkpoint written by one backend loads into another.

Layout of `checkpoint_dir/`:

- `manifest.json`: `format`, `version` (`FORMAT_VERSION`; version 1, written before rows carried digests, loads
  unverified with a one-line warning; any other version is refused in one line), the caller's `metadata` and the
  partition ids;
- `store.safetensors`: every partition's state (declaration, keys in first-put order, schemas, which keys hold
  each field, tags, claim cursors) and each field's rows as one `Column` (values + lengths) with their `[N]` row
  digests (`checksum.row_digests`), written by `relayrl.utils.state_file` (tensors in safetensors, the rest JSON;
  nothing is pickled, dtypes and bits exact).

Why digests in the file: the rows are read through the client's checked gets, but a put computes fresh digests of
whatever it is given, so a row damaged on disk between save and load would enter the store vouched for. Load
compares each field's rows with the digests saved beside them before any row is put, and a mismatch is one
`DamagedCheckpointError` line naming the file, partition, key and field (a `CheckpointError`: the CLI refuses the
checkpoint in one line, exit 2, as it does an unreadable one). They are written and checked whatever
`data_plane.verify_checksums` says: once per checkpoint, not per step. The JSON part (keys, tags, cursors) is not
covered by them; the trainer checkpoint's manifest hashes every file, this one included.

What round-trips, and why it is enough for an exact resume: the rows (every written field of every live key), the
key order (claims and `list_sample_ids` follow it), the field schemas (a later write of another dtype still
raises), the tags, and each task's claimed keys (a resumed consumer neither re-claims nor skips a sample).
Not saved: puts still in flight (checkpoints are taken between steps), the capacity (the resumed config decides)
and metrics counters.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from relayrl.data_plane.checksum import row_digests
from relayrl.data_plane.codec import Column
from relayrl.utils.state_file import CheckpointError, load_state_file, save_state_file

if TYPE_CHECKING:
    from relayrl.data_plane.interfaces import DataPlaneClient

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "STORE_FILE", "DamagedCheckpointError", "load_store", "save_store"]

FORMAT = "relayrl-data-plane"
FORMAT_VERSION = 2
UNVERIFIED_VERSION = 1
"""Written before the rows carried digests: still loaded, unverified, with a warning."""
MANIFEST = "manifest.json"
STORE_FILE = "store.safetensors"

logger = logging.getLogger(__name__)


class DamagedCheckpointError(CheckpointError):
    """A saved row differs from the digest saved with it: names the file, partition, key and field."""

    def __init__(self, message: str, key: str = "", field: str = ""):
        super().__init__(message)
        self.key, self.field = key, field


def save_store(client: DataPlaneClient, checkpoint_dir: Path, metadata: dict[str, Any]) -> None:
    """Write the store to `checkpoint_dir` via a sibling temp dir and a rename (an existing one is replaced)."""
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"data plane checkpoint metadata must be JSON (str keys, finite numbers): {e}") from None
    states = client.export_state()
    partitions: list[dict[str, Any]] = []
    for pid, state in states.items():
        columns: dict[str, dict[str, Any]] = {}
        for name, keys in state["written"].items():
            if keys:
                col = client.get_samples(keys, pid, [name])[name]
                columns[name] = {"values": col.values, "lengths": col.lengths, "checksums": row_digests(col)}
        partitions.append({"id": pid, "state": state, "columns": columns})
    checkpoint_dir = checkpoint_dir.absolute()
    checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint_dir.with_name(f".{checkpoint_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        save_state_file(tmp / STORE_FILE, {"partitions": partitions})
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "partitions": list(states), "metadata": metadata}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _replace_dir(tmp, checkpoint_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_store(client: DataPlaneClient, checkpoint_dir: Path) -> dict[str, Any]:
    """Re-register each saved partition, restore its bookkeeping, put its rows back; returns the metadata."""
    manifest = read_manifest(checkpoint_dir)
    store_file = checkpoint_dir / STORE_FILE
    raw = load_state_file(store_file)
    if manifest["version"] == UNVERIFIED_VERSION:
        logger.warning("%s: data plane checkpoint version 1 has no row digests; its rows load unverified", store_file)
    else:
        for part in raw["partitions"]:
            for name, col in part["columns"].items():
                _verify_column(store_file, part["id"], name, part["state"]["written"][name], col)
    for part in raw["partitions"]:
        pid, state = part["id"], part["state"]
        client.register_partition(
            pid, state["fields"], int(state["num_samples"]), state["tasks"], state["grpo_group_size"]
        )
        client.restore_state(pid, state)
        for name, col in part["columns"].items():
            client.put_samples(state["written"][name], pid, {name: Column(col["values"], col["lengths"])})
    metadata: dict[str, Any] = manifest.get("metadata") or {}
    return metadata


def read_manifest(checkpoint_dir: Path) -> dict[str, Any]:
    """The manifest, or `CheckpointError` in one line when it is missing, foreign or of another version."""
    path = checkpoint_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable data plane checkpoint manifest ({type(e).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a relayrl data plane checkpoint (format {FORMAT!r} expected)")
    if manifest.get("version") not in (FORMAT_VERSION, UNVERIFIED_VERSION):
        raise CheckpointError(
            f"{path}: data plane checkpoint version {manifest.get('version')!r} is not supported "
            f"(this relayrl reads versions {UNVERIFIED_VERSION} and {FORMAT_VERSION})"
        )
    return manifest


def _verify_column(store_file: Path, partition_id: str, name: str, keys: list[str], col: dict[str, Any]) -> None:
    """The saved rows of one field against the digests saved with them (`[N]`, in `keys` order); raises
    `DamagedCheckpointError` naming the file, partition, first damaged key and field."""
    where = f"{store_file}: data plane checkpoint partition {partition_id!r}"
    fix = "the file changed after it was saved; load an intact copy or an earlier checkpoint"
    want = col.get("checksums")
    try:
        if want is None or tuple(want.shape) != (len(keys),):
            raise ValueError(f"{0 if want is None else want.numel()} row digests for {len(keys)} keys")
        got = row_digests(Column(col["values"], col["lengths"])).numpy()  # [N]
    except (TypeError, ValueError) as e:  # damaged lengths, or digests that do not fit the rows
        raise DamagedCheckpointError(f"{where}, field '{name}': rows unreadable ({e}); {fix}", field=name) from None
    bad = np.flatnonzero(got != want.numpy())
    if bad.size:
        key = keys[int(bad[0])]
        more = f" ({bad.size} rows of this field differ)" if bad.size > 1 else ""
        raise DamagedCheckpointError(
            f"{where}, key {key!r}, field '{name}' does not match the digest saved with it{more}; {fix}",
            key=key,
            field=name,
        )


def _replace_dir(tmp: Path, final: Path) -> None:
    """Publish `tmp` as `final`; an existing `final` is moved aside first and removed after (no moment without
    either the old or the new complete directory)."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)

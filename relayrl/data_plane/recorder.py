"""Flight recorder files: one step's rollout columns as one Parquet file, `RUN_DIR/rollouts/step_NNNNNN.parquet`.

One row per sample. Per-token columns (token ids, masks, log-probs, per-token advantages) are Parquet lists holding
exactly the sample's `input_lengths` tokens (no padding); per-row columns are scalars; text and environment metadata
are strings. The torch dtype of every tensor column is kept in the file's metadata (`relayrl.dtypes`), so a replay
rebuilds bit-identical tensors (bfloat16, which Arrow lacks, is stored as float32: exact).

Reading from the store goes through the backend under the metering wrapper: the recorder's reads are its own cost
(reported as `timing/train/flight_recorder`), not the step's data-plane traffic, so recording changes no metric.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta

ROLLOUTS_DIR = "rollouts"
DTYPES_KEY = b"relayrl.dtypes"
INFO_KEY = b"relayrl.info"
_PREFIX, _SUFFIX = "step_", ".parquet"

#: What a recorded column may be: a packed Column, a dense [N] tensor, or per-row Python values (text, ints, floats).
RecordValue = Column | torch.Tensor | Sequence[Any]


def warm_up() -> None:
    """Write a one-row table to memory now: the first conversion imports pandas and sets up the zstd codec (about
    half a second), which would otherwise land in the first recorded step."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.ListArray.from_arrays(pa.array(np.array([0, 1], dtype=np.int32)), pa.array(np.zeros(1, np.float32)))
    pq.write_table(pa.table({"x": column, "s": pa.array(["a"])}), pa.BufferOutputStream(), compression="zstd")


def step_path(rollouts_dir: str | Path, step: int) -> Path:
    return Path(rollouts_dir) / f"{_PREFIX}{step:06d}{_SUFFIX}"


def recorded_steps(rollouts_dir: str | Path) -> list[int]:
    """Steps with a recording in `rollouts_dir`, ascending (empty when the directory does not exist)."""
    d = Path(rollouts_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.glob(f"{_PREFIX}*{_SUFFIX}"):
        digits = p.name[len(_PREFIX) : -len(_SUFFIX)]
        if digits.isdigit():
            out.append(int(digits))
    return sorted(out)


def read_store_columns(client: DataPlaneClient, meta: KVBatchMeta, fields: Sequence[str]) -> dict[str, Column]:
    """`fields` of `meta`'s keys as stored (jagged per-token, dense per-row), fetched past the metering wrapper."""
    inner: DataPlaneClient = getattr(client, "inner", client)
    return dict(inner.get_samples(meta.keys, meta.partition_id, list(fields)))


def _arrow_array(name: str, value: RecordValue, n_rows: int) -> tuple[Any, str | None]:
    """(pyarrow array, torch dtype name or None) for one column."""
    import pyarrow as pa

    if isinstance(value, torch.Tensor) and value.dim() == 1:
        value = Column.dense(value)
    if isinstance(value, Column):
        dtype = str(value.dtype).removeprefix("torch.")
        values = value.values.detach().cpu()
        if values.dtype == torch.bfloat16:
            values = values.float()
        if value.num_rows != n_rows:
            raise ValueError(f"flight recorder: column '{name}' has {value.num_rows} rows for {n_rows} samples")
        if values.dim() != 1:
            raise ValueError(f"flight recorder: column '{name}' has trailing shape {tuple(values.shape[1:])}")
        flat = pa.array(values.numpy())
        if value.lengths is None:
            return flat, dtype
        offsets = np.zeros(n_rows + 1, dtype=np.int32)  # [N + 1]
        np.cumsum(value.lengths.numpy(), out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets), flat), dtype
    rows = list(value)
    if len(rows) != n_rows:
        raise ValueError(f"flight recorder: column '{name}' has {len(rows)} rows for {n_rows} samples")
    return pa.array(rows), None


def write_step(
    rollouts_dir: str | Path,
    step: int,
    columns: Mapping[str, RecordValue],
    info: Mapping[str, Any],
    keep_last: int,
) -> Path:
    """Write one step's file atomically (temporary name, then rename), then delete all but the newest `keep_last`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n_rows = len(columns["sample_key"])  # type: ignore[arg-type]
    arrays, dtypes = {}, {}
    for name, value in columns.items():
        arrays[name], dtype = _arrow_array(name, value, n_rows)
        if dtype is not None:
            dtypes[name] = dtype
    table = pa.table(arrays)
    table = table.replace_schema_metadata(
        {DTYPES_KEY: json.dumps(dtypes).encode(), INFO_KEY: json.dumps(dict(info), default=float).encode()}
    )
    out = step_path(rollouts_dir, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)  # readers verify every page
    os.replace(tmp, out)
    for old in recorded_steps(rollouts_dir)[:-keep_last]:
        step_path(rollouts_dir, old).unlink(missing_ok=True)
    return out


def read_step(rollouts_dir: str | Path, step: int) -> Any:
    """The recorded `pyarrow.Table` of `step`; FileNotFoundError naming what is recorded when it is missing."""
    import pyarrow.parquet as pq

    path = step_path(rollouts_dir, step)
    if not path.is_file():
        have = recorded_steps(rollouts_dir)
        span = f"steps {have[0]}..{have[-1]} ({len(have)} files)" if have else "no steps"
        raise FileNotFoundError(
            f"no flight recording of step {step} in {rollouts_dir} (it holds {span}); record it with "
            "logger.flight_recorder.enabled=true, every_n_steps=1 and a keep_last that covers it"
        )
    try:  # the footer, every page's CRC and its decompression: a damaged file is one line naming it
        return pq.read_table(path, page_checksum_verification=True)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RecordingDamagedError(f"flight recording {path} is damaged or truncated ({first})") from None


class RecordingDamagedError(ValueError):
    """A flight recording file that cannot be read back (truncated, corrupted); the message names it."""


def table_info(table: Any) -> dict[str, Any]:
    """The step-level values recorded with the file (rollout metrics, weight version, trainer)."""
    meta = table.schema.metadata or {}
    return dict(json.loads(meta.get(INFO_KEY, b"{}")))


def table_column(table: Any, name: str) -> Column:
    """A recorded tensor column back as the `Column` it was written from (same dtype, same packing)."""
    dtypes = json.loads((table.schema.metadata or {}).get(DTYPES_KEY, b"{}"))
    if name not in dtypes:
        raise KeyError(f"flight recording has no tensor column '{name}' (it has {sorted(dtypes)})")
    dtype = getattr(torch, dtypes[name])
    col = table.column(name).combine_chunks()
    if hasattr(col, "offsets"):  # a list column: per-token values
        offsets = col.offsets.to_numpy(zero_copy_only=False).astype(np.int64)  # [N + 1]
        flat = col.flatten().to_numpy(zero_copy_only=False)
        values = torch.from_numpy(np.array(flat, copy=True)).to(dtype)
        return Column.jagged(values, torch.from_numpy(np.diff(offsets)))
    values = torch.from_numpy(np.array(col.to_numpy(zero_copy_only=False), copy=True)).to(dtype)
    return Column.dense(values)

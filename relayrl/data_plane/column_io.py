"""Column helpers above the client: read a meta's fields as padded tensors, write per-token results back
unpadded, and the rollout's first write that creates every sample.

Per-token fields (`TOKEN_ALIGNED_FIELDS`) given as right-padded `[N, S, ...]` tensors are packed jagged with the
meta's `sequence_lengths`, which strips any local, forward or sequence-parallel padding before it hits the store.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from relayrl.data_plane.codec import Column, as_column, materialize
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta, resolve_fields
from relayrl.data_plane.schema import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_LENGTHS, PAD_TO_MULTIPLE, TOKEN_ALIGNED_FIELDS
from relayrl.distributed.batched_data_dict import BatchedDataDict


def pack_fields(
    fields: Mapping[str, Any],
    lengths: Sequence[int] | torch.Tensor | None,
    token_aligned_fields: Collection[str] = TOKEN_ALIGNED_FIELDS,
) -> dict[str, Column]:
    """Columns for a put: token-aligned `[N, S, ...]` tensors → jagged by `lengths`; everything else dense."""
    lens = None if lengths is None else torch.as_tensor(lengths, dtype=torch.int64).reshape(-1).cpu()
    out: dict[str, Column] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor) and not value.is_nested and name in token_aligned_fields:
            if value.dim() >= 2:
                if lens is None:
                    raise ValueError(f"per-token field '{name}' needs sequence lengths to be packed (meta has none)")
                out[name] = Column.from_padded(value.detach(), lens)
                continue
        out[name] = as_column(name, value)
    return out


def read_columns(
    client: DataPlaneClient,
    meta: KVBatchMeta,
    select_fields: Sequence[str] | None = None,
    *,
    pad_value_dict: Mapping[str, Any] | None = None,
) -> BatchedDataDict[Any]:
    """Fetch `meta`'s keys and right-pad per-token fields to `extra_info[GLOBAL_FORWARD_PAD_SEQLEN]` (or max)."""
    names = resolve_fields(meta, select_fields)
    batch = client.get_samples(meta.keys, meta.partition_id, names)
    return materialize(batch, pad_value_dict, int(meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0)))


def write_columns(client: DataPlaneClient, meta: KVBatchMeta, fields: Mapping[str, Any]) -> KVBatchMeta:
    """Write results for `meta.keys` (row i ↔ key i); per-token fields are unpadded via `meta.sequence_lengths`."""
    cols = pack_fields(fields, meta.sequence_lengths)
    return client.put_samples(meta.keys, meta.partition_id, cols)


def first_write(
    batch: Mapping[str, Any],
    *,
    keys: Sequence[str],
    client: DataPlaneClient,
    partition_id: str,
    extra_info: Mapping[str, Any] | None = None,
    task_name: str | None = "train",
    pad_to_multiple: int = 1,
    tags: Sequence[Mapping[str, Any]] | None = None,
) -> KVBatchMeta:
    """The rollout's single put creating every sample; returns the dispatch meta the driver carries.

    `batch[INPUT_LENGTHS]` (`[N]`) gives the sequence lengths; every other value must be a tensor or Column
    (a non-tensor raises rather than being skipped, so nothing is lost silently).
    """
    if INPUT_LENGTHS not in batch:
        raise ValueError(f"first_write needs '{INPUT_LENGTHS}' in the batch to pack per-token fields")
    lengths = batch[INPUT_LENGTHS]
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError(f"'{INPUT_LENGTHS}' must be a 1-D tensor, got {type(lengths).__name__}")
    n = lengths.shape[0]
    if n == 0 or len(keys) != n:
        raise ValueError(f"first_write: {len(keys)} keys must match batch size {n} (and the batch must be non-empty)")
    if tags is not None and len(tags) != n:
        raise ValueError(f"first_write: tags ({len(tags)}) must match batch size {n}")
    cols = pack_fields(batch, lengths)
    receipt = client.put_samples(keys, partition_id, cols, tags)
    info = dict(extra_info or {})
    if pad_to_multiple > 1:
        info[PAD_TO_MULTIPLE] = pad_to_multiple
    return KVBatchMeta(
        partition_id=partition_id,
        keys=list(keys),
        fields=list(cols),
        sequence_lengths=[int(x) for x in lengths.tolist()],
        tags=receipt.tags,
        extra_info=info,
        task_name=task_name,
    )

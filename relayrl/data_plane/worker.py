"""Worker side of the data plane: a mixin giving each policy worker its own client, a fetch of exactly its
shard's keys at the batch-wide padded width, and a leader-only write-back of per-token results.

Every DP rank materializes at `meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN]`, so all ranks share one sequence
dimension (collectives and micro-batch plans line up). Ranks that hold a replica of the same shard (tensor,
context or pipeline parallel siblings) all fetch, but only the replica leader writes, so a key is never
written twice for one result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column, materialize
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.data_plane.schema import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_IDS, PACKING_INFO_KEYS, TOKEN_ALIGNED_FIELDS
from relayrl.distributed.batched_data_dict import BatchedDataDict

REPLICATED_AXES: tuple[str, ...] = ("tensor_parallel", "context_parallel", "pipeline_parallel")


class DataPlaneWorkerMixin:
    """Mix into a policy worker. Override `_local_coords` when the worker shards a model across ranks."""

    _dp_client: DataPlaneClient | None = None

    def setup_data_plane(self, cfg: DataPlaneConfig | Mapping[str, Any]) -> None:
        """Attach to the driver's store (idempotent; the driver built it with `bootstrap=True`)."""
        if self._dp_client is None:
            self._dp_client = build_data_plane_client(cfg, bootstrap=False)

    def _require_dp_client(self) -> DataPlaneClient:
        if self._dp_client is None:
            raise RuntimeError("data plane not set up on this worker; call setup_data_plane(cfg) first")
        return self._dp_client

    # ------------------------------------------------------------------ replica leadership
    def _local_coords(self) -> dict[str, int]:
        """This rank's coordinates on the replicated axes. Single-process (no torch.distributed) → `{}`.

        With torch.distributed up there is no safe default (every rank would write back), so workers that
        run distributed must override this.
        """
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return {}
        raise NotImplementedError(
            f"{type(self).__name__} runs under torch.distributed and must override _local_coords() "
            f"(coordinates on {REPLICATED_AXES}) so only one replica writes back"
        )

    def _is_replica_leader(self) -> bool:
        coords = self._local_coords()
        return all(coords.get(axis, 0) == 0 for axis in REPLICATED_AXES)

    def _pad_value_dict(self) -> dict[str, Any]:
        """Pad `input_ids` with the tokenizer's pad id when the worker has one; everything else pads with 0."""
        tokenizer = getattr(self, "tokenizer", None)
        pad_id = getattr(tokenizer, "pad_token_id", None)
        return {} if pad_id is None else {INPUT_IDS: pad_id}

    # ------------------------------------------------------------------ fetch
    def _fetch(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> BatchedDataDict[Any]:
        """This shard's rows (exactly `meta.keys`, in order), per-token fields right-padded to the global width."""
        fields = list(select_fields) if select_fields is not None else meta.fields
        if not fields:
            raise ValueError(f"_fetch: meta for partition {meta.partition_id!r} names no fields to fetch")
        batch = self._require_dp_client().get_samples(meta.keys, meta.partition_id, fields)
        pad_to = int(meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0))
        return materialize(batch, self._pad_value_dict(), pad_to)

    @staticmethod
    def _packing_metadata(meta: KVBatchMeta) -> dict[str, Any]:
        """Driver-planned micro-batches for this rank (trusted over local re-packing so ranks stay in step)."""
        return {k: meta.extra_info[k] for k in PACKING_INFO_KEYS if k in meta.extra_info}

    # ------------------------------------------------------------------ write-back
    def _write_back_result_field(
        self, meta: KVBatchMeta, name: str, tensor: torch.Tensor, *, per_token: bool | None = None
    ) -> bool:
        """Write `tensor` (row i ↔ `meta.keys[i]`) as field `name`; returns whether this rank wrote.

        Per-token results (`per_token`, default: `name` in TOKEN_ALIGNED_FIELDS) given as `[N, S, ...]` are
        stored unpadded: row i keeps its first `meta.sequence_lengths[i]` positions, dropping local, global and
        sequence-parallel padding. Dtype is kept (no cast); non-leaders return False without writing.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"write-back of '{name}' needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() == 0 or tensor.shape[0] != meta.size:
            raise ValueError(
                f"write-back of '{name}': shape mismatch, {tuple(tensor.shape)} for {meta.size} keys of the meta"
            )
        client = self._require_dp_client()
        if not self._is_replica_leader():
            return False
        value = tensor.detach().to("cpu")
        if per_token is None:
            per_token = name in TOKEN_ALIGNED_FIELDS
        column: Column | torch.Tensor = value
        if per_token and value.dim() >= 2:
            if meta.sequence_lengths is None:
                raise ValueError(f"write-back of per-token '{name}' needs meta.sequence_lengths to unpad it")
            column = Column.from_padded(value, meta.sequence_lengths)
        client.put_samples(meta.keys, meta.partition_id, {name: column})
        return True

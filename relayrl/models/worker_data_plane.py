"""What a data-plane worker holds: its connection to the store, and the entry points every such worker offers.

A data-plane worker (`TQPolicyWorker`, `TQValueWorker`) *is* a policy or critic replica and *has* a store
connection. The connection is a component, `WorkerDataPlane`, rather than a second base class: the replica keeps one
line of inheritance, and every fetch and write-back goes through one object the worker owns. `DataPlaneWorker` is
the typed seam the driver-side façade (`models.tq_facade.TQFacade`) dispatches to; groups call by method name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import DataPlaneConfig, PolicyConfig, ValueConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.worker import DataPlaneWorkerMixin
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.microbatch import with_plan

#: A worker pass over fetched rows: (batch, micro-batch size) -> result columns.
RowPass = Callable[[BatchedDataDict, int | None], BatchedDataDict]


class DataPlaneWorker(Protocol):
    """The entry points both data-plane workers offer the façade (beyond their own `*_presharded` passes)."""

    def setup_data_plane(self, cfg: DataPlaneConfig | Mapping[str, Any]) -> None:
        """Attach this rank to the store the driver bootstrapped (idempotent)."""
        ...

    def train_presharded(
        self, meta: KVBatchMeta, loss_fn: LossFunction, eval_mode: bool, gbs: int, mbs: int
    ) -> dict[str, Any]:
        """Fetch this rank's training rows, then run the ordinary `train`; returns its result."""
        ...

    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]:
        """This rank's client counters (`data_plane/*`)."""
        ...


class WorkerDataPlane(DataPlaneWorkerMixin):
    """One rank's store connection: fetch exactly its keys at the batch-wide padded width, write results back.

    Pure data parallelism (no tensor/context/pipeline axes): every rank leads its own replica and writes back its
    own keys, also under torch.distributed (the Ray executor). `tokenizer` gives `input_ids` their pad id.
    """

    def __init__(self, cfg: PolicyConfig | ValueConfig, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer

    def _local_coords(self) -> dict[str, int]:
        return {}

    def attach(self, cfg: DataPlaneConfig | Mapping[str, Any]) -> None:
        """Build this rank's client with `bootstrap=False` (idempotent)."""
        self.setup_data_plane(cfg)

    def fetch(self, meta: KVBatchMeta, select_fields: tuple[str, ...] | None = None) -> BatchedDataDict[Any]:
        """This shard's rows (exactly `meta.keys`, in order); `select_fields` defaults to `meta.fields`."""
        return self._fetch(meta, select_fields)

    def fetch_planned(
        self,
        meta: KVBatchMeta,
        select_fields: tuple[str, ...] | None = None,
        complete: Callable[[BatchedDataDict], BatchedDataDict] | None = None,
    ) -> BatchedDataDict:
        """`fetch`, brought to the layout a pass expects by `complete`, carrying the driver's micro-batch plan."""
        data = self._fetch(meta, select_fields)
        return with_plan(data if complete is None else complete(data), self.cfg, meta.extra_info)

    def write_back(self, meta: KVBatchMeta, name: str, tensor: torch.Tensor, *, per_token: bool | None = None) -> bool:
        """Write `tensor` (row i <-> `meta.keys[i]`) as field `name`; per-token `[N, S]` columns are stored unpadded."""
        return self._write_back_result_field(meta, name, tensor, per_token=per_token)

    def write_back_pass(
        self,
        meta: KVBatchMeta,
        compute: RowPass,
        micro_batch_size: int | None,
        result_key: str,
        field: str,
        fields: tuple[str, ...] | None = None,
    ) -> None:
        """Fetch this rank's rows (`fields`, default `meta.fields`), run `compute`, write `result_key` back as the
        per-token column `field`. Returns None: only the store sees the result."""
        if meta.size == 0:  # more ranks than rows: this rank has nothing to do
            return None
        result = compute(self.fetch_planned(meta, fields), micro_batch_size)  # [n, W]
        if result_key not in result:
            raise RuntimeError(f"worker result is missing key '{result_key}' (has {sorted(result)})")
        self._write_back_result_field(meta, field, result[result_key], per_token=True)
        return None

    def train_rows(
        self, meta: KVBatchMeta, complete: Callable[[BatchedDataDict], BatchedDataDict] | None = None
    ) -> BatchedDataDict:
        """This rank's training rows (`meta.fields`), completed to the trainer's layout, with the driver's plan."""
        if meta.size == 0:
            raise ValueError(
                "train_presharded: this rank's meta has no keys; the global batch must give every rank rows"
            )
        return self.fetch_planned(meta, None, complete)

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """This rank's client counters (`data_plane/*`; none before `attach`)."""
        return {} if self._dp_client is None else self._dp_client.metrics(reset)

    @property
    def attached(self) -> bool:
        return self._dp_client is not None

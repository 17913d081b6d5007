"""What the data-plane façades (`TQPolicy`, `TQValue`) share: dispatch by `KVBatchMeta` instead of by batch.

A data-plane façade ships metadata only: each dispatch splits a meta's key list over the DP ranks with
`shard_meta_for_dp` (no new keys), every worker fetches its own rows, computes and writes per-token results back
under the same keys. `TQFacade` holds what both façades do the same way: connecting the driver's client and the
workers' (the policy bootstraps the store, the critic attaches to it), the padded width every reader uses,
driver-side reads and writes, `train_from_meta`, and the step's end, which fails on any key left behind.

A façade *holds* the `Policy` / `Value` it drives (`model`, built with data-plane workers) instead of inheriting
from it, and forwards explicitly what its callers use of it: what it adds and what it passes through stay apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import ClusterConfig, DataPlaneConfig
from relayrl.data_plane.column_io import pack_fields, read_columns
from relayrl.data_plane.factory import close_quietly, connect_driver_and_workers, validate_data_plane_config
from relayrl.data_plane.interfaces import DataPlaneClient, DataPlaneError, KVBatchMeta, format_keys
from relayrl.data_plane.preshard import shard_meta_for_dp
from relayrl.data_plane.schema import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_IDS,
    PAD_TO_MULTIPLE,
    TOKEN_ALIGNED_FIELDS,
    round_up,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import WorkerGroup
from relayrl.models.facade_base import ModelFacade, check_train_sizes, timed
from relayrl.models.microbatch import PlannerArgs, packing_args, shard_meta
from relayrl.models.worker_base import ModelConfig
from relayrl.models.worker_data_plane import DataPlaneWorker
from relayrl.utils.timer import Timer

M = TypeVar("M", bound=ModelFacade[Any])
TW = TypeVar("TW", bound=DataPlaneWorker)


class DataPlaneLeakError(DataPlaneError, RuntimeError):
    """A step ended with keys still in its partition: something minted them and nobody consumed or discarded them."""


def check_meta(meta: KVBatchMeta, what: str) -> None:
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"{what}: expected a KVBatchMeta, got {type(meta).__name__}")
    if meta.size == 0:
        raise ValueError(f"{what}: meta for partition {meta.partition_id!r} has no keys")
    if meta.sequence_lengths is None:
        raise ValueError(f"{what}: meta.sequence_lengths is required (per-token results are stored unpadded by it)")


def check_sample_count(num_samples: int, what: str) -> None:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"{what}: num_samples must be a positive int, got {num_samples!r}")


def require_written(results: Sequence[object], method_name: str) -> None:
    """Write-back passes return None on every rank: their result went to the store, not to the driver."""
    if any(r is not None for r in results):
        raise RuntimeError(f"{method_name} must write its result to the store and return None")


def validate_facade_args(dp_cfg: DataPlaneConfig | Mapping[str, Any], tq_partition_id: str) -> DataPlaneConfig:
    """The parsed `data_plane:` config; raises before any model is loaded when it or the partition id is bad."""
    parsed = validate_data_plane_config(dp_cfg)
    if not isinstance(tq_partition_id, str) or not tq_partition_id:
        raise ValueError(f"tq_partition_id must be a non-empty string, got {tq_partition_id!r}")
    return parsed


class TQFacade(Generic[M, TW]):
    """Drives a `ModelFacade` (`M`, whose workers are `TW`s) through the data plane (`dp_cfg` = `data_plane:`):
    bulk inputs and per-token outputs live in the store, the driver ships `KVBatchMeta`s."""

    #: Whether this façade's client bootstraps the store (the policy) or attaches to it in the driver (the critic).
    bootstraps_store: ClassVar[bool] = True
    #: Task name and default fields of a `train_from_meta` dispatch.
    train_task: ClassVar[str]
    train_fields: ClassVar[tuple[str, ...]]
    #: Timer labels of `train_from_meta`: around the meta sharding (None: untimed) and around the workers' call.
    train_meta_timers: ClassVar[tuple[str | None, str]]
    #: Per-token fields a driver write stores unpadded (by `meta.sequence_lengths`).
    token_fields: ClassVar[frozenset[str]] = TOKEN_ALIGNED_FIELDS
    #: Fields a training dispatch adds whenever the rollout wrote them (the sampler's kept sets, for the policy).
    optional_train_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: M, dp_cfg: DataPlaneConfig, tq_partition_id: str) -> None:
        """`model` is built with `TW` workers; `dp_cfg` and `tq_partition_id` are checked (`validate_facade_args`)."""
        if model.dp_size <= 0:
            raise ValueError(f"{type(self).__name__} needs a positive data-parallel size, got {model.dp_size}")
        self.model = model
        self.dp_cfg = dp_cfg
        self.tq_partition_id = tq_partition_id
        #: The held façade's group, typed by the data-plane workers it was built from.
        self._group = cast("WorkerGroup[TW]", model.worker_group)
        self.dp_client: DataPlaneClient = connect_driver_and_workers(
            self._group, dp_cfg, bootstrap=self.bootstraps_store
        )

    # ------------------------------------------------------------------ the held façade (explicit pass-through)
    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def cluster(self) -> ClusterConfig:
        return self.model.cluster

    @property
    def dp_size(self) -> int:
        return self.model.dp_size

    @property
    def worker_group(self) -> WorkerGroup[TW]:
        return self._group

    @property
    def weights_version(self) -> int:
        return self.model.weights_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def host_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.host_state_dict()

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Timer | None = None,
    ) -> dict[str, Any]:
        """The held façade's in-memory `train` (rows shipped from the driver, not fetched by key)."""
        return self.model.train(data, loss_fn, eval_mode, gbs=gbs, mbs=mbs, timer=timer)

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self.model.prepare_for_training(*args, **kwargs)

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self.model.finish_training(*args, **kwargs)

    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.model.save_checkpoint(weights_path, optimizer_path, tokenizer_path, *args, **kwargs)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self.model.load_checkpoint(weights_path, optimizer_path)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> bool:
        """Close the driver's client (errors become warnings), then shut the workers down."""
        close_quietly(self.dp_client)
        return self.model.shutdown()

    # ------------------------------------------------------------------ partition lifecycle
    def discard_samples(self, keys: Sequence[str], partition_id: str) -> int:
        """Drop `keys` from the store (step end, or rows filtered mid-step); returns how many were present."""
        if isinstance(keys, str):
            raise TypeError("discard_samples takes a sequence of keys, not a single string")
        return self.dp_client.clear_samples(list(keys), partition_id)

    def finish_step(self, meta: KVBatchMeta) -> None:
        """Clear every key of the step's meta, then require the partition to be empty; names leaked keys."""
        self.discard_samples(meta.keys, meta.partition_id)
        leaked = self._partition_keys(meta.partition_id)
        if leaked:
            raise DataPlaneLeakError(
                f"partition {meta.partition_id!r} still holds {len(leaked)} keys after finish_step: "
                f"{format_keys(leaked)}; every minted key must be trained on or discarded with discard_samples"
            )

    def _partition_keys(self, partition_id: str) -> list[str]:
        """Live keys of a partition (every backend lists them; the leak check names what was left behind)."""
        return list(self.dp_client.keys(partition_id))

    # ------------------------------------------------------------------ driver-side column access
    def _default_pad_multiple(self) -> int:
        """The padding multiple when the meta carries none (`PAD_TO_MULTIPLE` is stamped only when above 1)."""
        return 1

    def _stamp_pad_seqlen(self, meta: KVBatchMeta) -> None:
        """Set `extra_info[GLOBAL_FORWARD_PAD_SEQLEN]` (in place, once): the width every reader pads to.

        `round_up(max length, max(pad_to_multiple, sequence_length_round))`: the same width the legacy flatten
        gives, so driver reads and every DP rank's forward share one sequence dimension.
        """
        if not meta.sequence_lengths or GLOBAL_FORWARD_PAD_SEQLEN in meta.extra_info:
            return
        _, dynamic = self._packing_args("train_mb_tokens")
        seq_round = int(dynamic["sequence_length_round"]) if dynamic else 1
        pad_mult = int(meta.extra_info.get(PAD_TO_MULTIPLE, self._default_pad_multiple()))
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = round_up(max(meta.sequence_lengths), max(pad_mult, seq_round))

    def _pad_values(self) -> dict[str, Any]:
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        return {} if pad_id is None else {INPUT_IDS: pad_id}

    def read_from_dataplane(
        self, meta: KVBatchMeta, *, select_fields: Sequence[str], pad_value_dict: Mapping[str, Any] | None = None
    ) -> BatchedDataDict:
        """Fetch `select_fields` of `meta.keys` through the driver, padded to the workers' width. `input_ids`
        pads with the tokenizer's pad id unless `pad_value_dict` says otherwise (as the workers do)."""
        check_meta(meta, "read_from_dataplane")
        if isinstance(select_fields, str) or not select_fields:
            raise ValueError("read_from_dataplane: select_fields must be a non-empty list of field names")
        self._stamp_pad_seqlen(meta)
        pads = self._pad_values() if pad_value_dict is None else dict(pad_value_dict)
        return read_columns(self.dp_client, meta, list(select_fields), pad_value_dict=pads)

    def write_to_dataplane(self, meta: KVBatchMeta, fields: Mapping[str, Any]) -> None:
        """Write driver-computed columns under `meta.keys` (per-token `[N, S]` tensors are stored unpadded)."""
        check_meta(meta, "write_to_dataplane")
        if not isinstance(fields, Mapping) or not fields:
            raise ValueError("write_to_dataplane: fields must be a non-empty mapping of name -> tensor")
        cols = pack_fields(fields, meta.sequence_lengths, self.token_fields)
        self.dp_client.put_samples(meta.keys, meta.partition_id, cols)

    # ------------------------------------------------------------------ dispatch
    def _packing_args(self, mb_tokens_key: str) -> PlannerArgs:
        """(sequence_packing_args, dynamic_batching_args) for a stage (`logprob_mb_tokens` / `train_mb_tokens`):
        the planner's arguments (`models.microbatch.plan_rows`) from this model's `sequence_packing` /
        `dynamic_batching` config (at most one set; both None when both are off), fresh dicts every call."""
        return packing_args(self.cfg, mb_tokens_key)

    def _meta_shards(
        self,
        meta: KVBatchMeta,
        fields: Iterable[str],
        task_name: str,
        *,
        batch_size: int | None,
        stage: str,
        timer: Timer | None = None,
        label: str | None = None,
    ) -> list[KVBatchMeta]:
        """`meta`'s keys split over the DP ranks (fields narrowed to `fields`, tagged `task_name`; no new keys)."""
        self._stamp_pad_seqlen(meta)
        packing, dynamic = self._packing_args(stage)
        sub = dataclasses.replace(meta, fields=list(fields), task_name=task_name)
        with timed(timer, label):
            if packing is not None or dynamic is not None:  # the planner both trainers share
                return shard_meta(sub, self.dp_size, batch_size, (packing, dynamic))
            return shard_meta_for_dp(
                sub, self.dp_size, batch_size=batch_size, sequence_packing_args=packing, dynamic_batching_args=dynamic
            )

    def train_from_meta(
        self,
        meta: KVBatchMeta,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Timer | None = None,
        *,
        train_fields: Iterable[str] | None = None,
    ) -> dict[str, Any]:
        """`train` on `meta`'s rows: every field the step produced is already in the store under its keys; global
        batch k holds the same rows on every rank as in the legacy sharding. `train_fields` (default: the class's)
        drops inputs a step skipped. No write-back and no clear here (`finish_step` clears)."""
        check_meta(meta, "train_from_meta")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        check_train_sizes(meta.size, gbs, mbs, self.dp_size, "train_from_meta")
        fields = dict.fromkeys(self.train_fields if train_fields is None else train_fields)
        fields.update(dict.fromkeys(f for f in self.optional_train_fields if f in (meta.fields or ())))
        shard_label, call_label = self.train_meta_timers
        shards = self._meta_shards(
            meta, fields, self.train_task, batch_size=gbs, stage="train_mb_tokens", timer=timer, label=shard_label
        )
        with timed(timer, call_label):
            results = self._group.run_sharded(DataPlaneWorker.train_presharded, shards, loss_fn, eval_mode, gbs, mbs)
        return self.model.merge_results(results)

    # ------------------------------------------------------------------ observability
    def _worker_data_plane_metrics(self, reset: bool) -> list[dict[str, float]]:
        """Every worker's client counters (`data_plane/*`), in rank order."""
        return self._group.run_all(DataPlaneWorker.data_plane_metrics, reset)

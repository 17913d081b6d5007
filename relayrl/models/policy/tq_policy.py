"""TQPolicy: the data-plane counterpart of `Policy`, driven by `KVBatchMeta`s instead of BatchedDataDicts.

`train_from_meta` / `get_logprobs_from_meta` / `get_reference_policy_logprobs_from_meta` return what
`Policy.train` / `get_logprobs` / `get_reference_policy_logprobs` return, but take a meta naming per-sample keys
minted once at rollout (`SyncRolloutActor.rollout_to_tq`). Each dispatch splits the key list per DP rank with
`shard_meta_for_dp` (no new keys, same row assignment as the legacy sharding); every worker fetches its own rows,
computes, and writes results back under the same keys, so the driver ships metadata and only waits. The class also
owns the partition lifecycle: `prepare_step` registers the step's partition, `finish_step` clears it and fails
on any key left behind (a leak is an error, not a warning).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import DataPlaneConfig
from relayrl.data_plane.column_io import read_columns, write_columns
from relayrl.data_plane.factory import close_quietly, connect_driver_and_workers, validate_data_plane_config
from relayrl.data_plane.interfaces import DataPlaneClient, DataPlaneError, KVBatchMeta, format_keys
from relayrl.data_plane.preshard import shard_meta_for_dp
from relayrl.data_plane.schema import (
    DP_TRAIN_FIELDS,
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_IDS,
    LP_SEED_FIELDS,
    PAD_TO_MULTIPLE,
    TASK_PREV_LP,
    TASK_REF_LP,
    TASK_TRAIN,
    TRAIN_CONSUMER_TASKS,
    TRAIN_PARTITION,
    round_up,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import WorkerGroup
from relayrl.models.policy.lm_policy import Policy, _timed
from relayrl.models.policy.tq_worker import SEQ_ERROR_FIELDS, TQPolicyWorker
from relayrl.models.policy.worker import PolicyWorker


class DataPlaneLeakError(DataPlaneError, RuntimeError):
    """A step ended with keys still in its partition: something minted them and nobody consumed or discarded them."""


def _aggregate_train_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank train results → one dict, exactly as `Policy.train` merges them: rank 0's values (losses and
    grad norm are already global after the workers' all-reduce) and every rank's per-micro-batch metrics."""
    if not results:
        raise ValueError("_aggregate_train_results: no worker results to aggregate")
    merged: dict[str, list[Any]] = {}
    for res in results:
        for key, values in res["all_mb_metrics"].items():
            merged.setdefault(key, []).extend(values)
    return {**results[0], "all_mb_metrics": merged}


class TQPolicy(Policy):
    """`Policy` whose bulk inputs and per-token outputs live in the data plane (`dp_cfg` = `data_plane:` config).

    The driver bootstraps the store after the workers exist, then every worker attaches with `bootstrap=False`
    (the `memory` backend: the driver's in-process store; `ray`: the named store actor, from any process).
    """

    #: Worker class `Policy` builds its worker group from.
    worker_cls: type[PolicyWorker] = TQPolicyWorker
    _group: WorkerGroup[TQPolicyWorker]

    def __init__(
        self,
        *args: Any,
        dp_cfg: DataPlaneConfig | Mapping[str, Any],
        tq_partition_id: str = TRAIN_PARTITION,
        **kwargs: Any,
    ) -> None:
        parsed = validate_data_plane_config(dp_cfg)  # fail before any model is loaded
        if not isinstance(tq_partition_id, str) or not tq_partition_id:
            raise ValueError(f"tq_partition_id must be a non-empty string, got {tq_partition_id!r}")
        super().__init__(*args, **kwargs)
        if self.dp_size <= 0:
            raise ValueError(f"TQPolicy needs a positive data-parallel size, got {self.dp_size}")
        self.dp_cfg = parsed
        self.tq_partition_id = tq_partition_id
        self.dp_client: DataPlaneClient = connect_driver_and_workers(self._group, parsed, bootstrap=True)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> bool:
        """Close the driver's client (errors become warnings), then shut the workers down."""
        close_quietly(self.dp_client)
        return super().shutdown()

    # ------------------------------------------------------------------ partition lifecycle
    def prepare_step(self, num_samples: int, group_size: int | None = None) -> None:
        """Register this step's partition (`tq_partition_id`, reused every step) for every train field."""
        _check_count(num_samples, "prepare_step")
        self.dp_client.register_partition(
            self.tq_partition_id, list(DP_TRAIN_FIELDS), num_samples, list(TRAIN_CONSUMER_TASKS), group_size
        )

    def prepare_val_partition(self, num_samples: int, *, partition_id: str = "val") -> None:
        """Register one validation batch's partition: same schema, one consumer task, no GRPO grouping."""
        _check_count(num_samples, "prepare_val_partition")
        self.dp_client.register_partition(partition_id, list(DP_TRAIN_FIELDS), num_samples, [partition_id], None)

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
    def _stamp_pad_seqlen(self, meta: KVBatchMeta) -> None:
        """Set `extra_info[GLOBAL_FORWARD_PAD_SEQLEN]` (in place, once): the width every reader pads to.

        `round_up(max length, max(pad_to_multiple, sequence_length_round))`: the same width the legacy flatten
        gives, so driver reads and every DP rank's forward share one sequence dimension.
        """
        if not meta.sequence_lengths or GLOBAL_FORWARD_PAD_SEQLEN in meta.extra_info:
            return
        _, dynamic = self._packing_args("train_mb_tokens")
        seq_round = int(dynamic["sequence_length_round"]) if dynamic else 1
        pad_mult = int(meta.extra_info.get(PAD_TO_MULTIPLE, self.cfg.make_sequence_length_divisible_by))
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = round_up(max(meta.sequence_lengths), max(pad_mult, seq_round))

    def _pad_values(self) -> dict[str, Any]:
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        return {} if pad_id is None else {INPUT_IDS: pad_id}

    def read_from_dataplane(
        self, meta: KVBatchMeta, *, select_fields: Sequence[str], pad_value_dict: Mapping[str, Any] | None = None
    ) -> BatchedDataDict:
        """Fetch `select_fields` of `meta.keys` through the driver, padded to the workers' width. `input_ids`
        pads with the tokenizer's pad id unless `pad_value_dict` says otherwise (as the workers do)."""
        _check_meta(meta, "read_from_dataplane")
        if isinstance(select_fields, str) or not select_fields:
            raise ValueError("read_from_dataplane: select_fields must be a non-empty list of field names")
        self._stamp_pad_seqlen(meta)
        pads = self._pad_values() if pad_value_dict is None else dict(pad_value_dict)
        return read_columns(self.dp_client, meta, list(select_fields), pad_value_dict=pads)

    def write_to_dataplane(self, meta: KVBatchMeta, fields: Mapping[str, Any]) -> None:
        """Write driver-computed columns under `meta.keys` (per-token `[N, S]` tensors are stored unpadded)."""
        _check_meta(meta, "write_to_dataplane")
        if not isinstance(fields, Mapping) or not fields:
            raise ValueError("write_to_dataplane: fields must be a non-empty mapping of name -> tensor")
        write_columns(self.dp_client, meta, fields)

    # ------------------------------------------------------------------ dispatch
    def _packing_args(self, mb_tokens_key: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(sequence_packing_args, dynamic_batching_args) for a stage (`logprob_mb_tokens` / `train_mb_tokens`).
        relayrl's policy has neither sequence packing nor dynamic batching yet, so both are None."""
        if mb_tokens_key not in ("logprob_mb_tokens", "train_mb_tokens"):
            raise ValueError(f"_packing_args: unknown stage key {mb_tokens_key!r}")
        return None, None

    def _logprob_dispatch(
        self,
        meta: KVBatchMeta,
        *,
        task_name: str,
        worker_method: Callable[[TQPolicyWorker, KVBatchMeta, int | None], None],
        timer_prefix: str,
        timer: Any,
        micro_batch_size: int,
    ) -> None:
        """Shard `meta` (log-prob seed fields only) over the DP ranks; each rank writes its result back."""
        _check_meta(meta, task_name)
        self._stamp_pad_seqlen(meta)
        packing, dynamic = self._packing_args("logprob_mb_tokens")
        lp_meta = dataclasses.replace(meta, fields=list(LP_SEED_FIELDS), task_name=task_name)
        with _timed(timer, f"{timer_prefix}/shard_meta"):
            shards = shard_meta_for_dp(
                lp_meta, self.dp_size, batch_size=None, sequence_packing_args=packing, dynamic_batching_args=dynamic
            )
        with _timed(timer, f"{timer_prefix}/submit_futures"):
            results = self._group.run_sharded(worker_method, shards, micro_batch_size)
        unexpected = [r for r in results if r is not None]
        if unexpected:
            raise RuntimeError(f"{worker_method.__name__} must write its result to the store and return None")

    def get_logprobs_from_meta(self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Any = None) -> None:
        """Policy log-probs of `meta`'s rows; they land in the store as `prev_logprobs`."""
        self._logprob_dispatch(
            meta,
            task_name=TASK_PREV_LP,
            worker_method=TQPolicyWorker.get_logprobs_presharded,
            timer_prefix="get_logprobs",
            timer=timer,
            micro_batch_size=micro_batch_size or self.logprob_batch_size,
        )

    def get_reference_policy_logprobs_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Any = None
    ) -> None:
        """Reference-model log-probs of `meta`'s rows; they land as `reference_policy_logprobs`."""
        if not self.has_reference:
            raise RuntimeError("reference log-probs requested but the policy was built with init_reference_model=False")
        self._logprob_dispatch(
            meta,
            task_name=TASK_REF_LP,
            worker_method=TQPolicyWorker.get_reference_policy_logprobs_presharded,
            timer_prefix="get_reference_policy_logprobs",
            timer=timer,
            micro_batch_size=micro_batch_size or self.logprob_batch_size,
        )

    def train_from_meta(
        self,
        meta: KVBatchMeta,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Any = None,
        *,
        train_fields: Iterable[str] = DP_TRAIN_FIELDS,
    ) -> dict[str, Any]:
        """`Policy.train` on `meta`'s rows: every field the step produced is already in the store under its keys.
        `train_fields` drops inputs a step skipped (e.g. `prev_logprobs`); the workers zero-fill those as the
        legacy trainer does. No write-back and no clear here (`finish_step` clears)."""
        _check_meta(meta, "train_from_meta")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        if meta.size % gbs:
            raise ValueError(f"train_from_meta: {meta.size} rows are not a positive multiple of the global batch {gbs}")
        if gbs % self.dp_size or (gbs // self.dp_size) % mbs:
            raise ValueError(
                f"train_from_meta: global batch {gbs} must split into {self.dp_size} data-parallel shards of whole "
                f"micro-batches of {mbs} rows"
            )
        self._stamp_pad_seqlen(meta)
        packing, dynamic = self._packing_args("train_mb_tokens")
        train_meta = dataclasses.replace(meta, fields=list(dict.fromkeys(train_fields)), task_name=TASK_TRAIN)
        with _timed(timer, "policy_training/shard_meta"):
            shards = shard_meta_for_dp(
                train_meta, self.dp_size, batch_size=gbs, sequence_packing_args=packing, dynamic_batching_args=dynamic
            )
        with _timed(timer, "policy_training/submit_training_futures"):
            results = self._group.run_sharded(
                TQPolicyWorker.train_presharded, shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
            )
        return _aggregate_train_results(results)

    def seq_logprob_error_from_meta(self, meta: KVBatchMeta, timer: Any = None) -> BatchedDataDict:
        """Per-row `seq_logprob_error` and `num_loss_tokens` `[N]` (meta order), reduced on the workers from the
        stored `token_mask`, `sample_mask`, `prev_logprobs` and `generation_logprobs`: the driver gets 8 bytes a
        row instead of the per-token columns. Write the step's `sample_mask` first; the legacy reduction uses it."""
        _check_meta(meta, "seq_logprob_error_from_meta")
        self._stamp_pad_seqlen(meta)
        err_meta = dataclasses.replace(meta, fields=list(SEQ_ERROR_FIELDS), task_name=TASK_PREV_LP)
        with _timed(timer, "seq_logprob_error/shard_meta"):
            shards = shard_meta_for_dp(err_meta, self.dp_size, batch_size=None)
        with _timed(timer, "seq_logprob_error/submit_futures"):
            results = self._group.run_sharded(TQPolicyWorker.seq_logprob_error_presharded, shards)
        position = {key: i for i, key in enumerate(meta.keys)}
        order = torch.tensor([position[k] for shard in shards for k in shard.keys])  # rank-order row -> meta row
        out: BatchedDataDict[Any] = BatchedDataDict()
        for name in ("seq_logprob_error", "num_loss_tokens"):
            gathered = torch.cat([r[name] for r in results])  # [N] in rank order
            out[name] = torch.empty_like(gathered).index_copy_(0, order, gathered)  # [N] in meta order
        return out

    # ------------------------------------------------------------------ observability
    def data_plane_metrics(self, reset: bool = False, *, extra: Sequence[Mapping[str, float]] = ()) -> dict[str, float]:
        """The driver client's `data_plane/*` metrics plus totals over every client (driver, workers, and the
        `extra` dicts, e.g. the rollout actor's), so a step can log bytes through the driver vs through the store:

        `data_plane/all/put_bytes` (written to the store), `data_plane/all/get_bytes` (read from it),
        `data_plane/driver_bytes` (put+get by the driver) and `data_plane/driver_fraction_of_written`.
        """
        out = self.dp_client.metrics(reset)
        parts: list[Mapping[str, float]] = [out, *self._group.run_all(TQPolicyWorker.data_plane_metrics, reset), *extra]
        written = sum(m.get("data_plane/put/bytes", 0.0) for m in parts)
        read = sum(m.get("data_plane/get/bytes", 0.0) + m.get("data_plane/get_data/bytes", 0.0) for m in parts)
        out["data_plane/all/put_bytes"] = written
        out["data_plane/all/get_bytes"] = read
        driver = out.get("data_plane/driver_bytes", 0.0)
        out["data_plane/driver_fraction_of_written"] = driver / written if written else 0.0
        return out


def _check_count(num_samples: int, what: str) -> None:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"{what}: num_samples must be a positive int, got {num_samples!r}")


def _check_meta(meta: KVBatchMeta, what: str) -> None:
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"{what}: expected a KVBatchMeta, got {type(meta).__name__}")
    if meta.size == 0:
        raise ValueError(f"{what}: meta for partition {meta.partition_id!r} has no keys")
    if meta.sequence_lengths is None:
        raise ValueError(f"{what}: meta.sequence_lengths is required (per-token results are stored unpadded by it)")

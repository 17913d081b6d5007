"""TQValue: the data-plane counterpart of `Value`, driven by `KVBatchMeta`s instead of BatchedDataDicts.

It attaches to the store the `TQPolicy` bootstrapped (the policy owns the store; the critic is a second tenant of
the same partition): its workers fetch their DP slice of the keys with `shard_meta_for_dp`, compute, and write
`values` / `advantages` / `returns` back under the same keys, so the driver ships metadata and only waits.
`train_from_meta` returns what `Value.train` returns. Because PPO rows carry more columns than GRPO's, the critic
also owns the PPO partition schema: `prepare_step` registers every field the step writes and `finish_step` clears
the step's keys and fails on any key left behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import DataPlaneConfig
from relayrl.data_plane.column_io import pack_fields, read_columns
from relayrl.data_plane.factory import close_quietly, connect_driver_and_workers, validate_data_plane_config
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta, format_keys
from relayrl.data_plane.preshard import shard_meta_for_dp
from relayrl.data_plane.schema import (
    DP_TRAIN_FIELDS,
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_IDS,
    PAD_TO_MULTIPLE,
    TOKEN_ALIGNED_FIELDS,
    TRAIN_CONSUMER_TASKS,
    TRAIN_PARTITION,
    round_up,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import WorkerGroup
from relayrl.models.policy.tq_policy import DataPlaneLeakError
from relayrl.models.value.lm_value import Value, _timed, merge_value_train_results
from relayrl.models.value.tq_worker import (
    ADV_FULL,
    ADV_RAW,
    ADV_WHITEN,
    RETURNS,
    REWARDS,
    VALUE_SEED_FIELDS,
    VALUE_TOKEN_FIELDS,
    VALUE_TRAIN_FIELDS,
    VALUES,
    TQValueWorker,
)
from relayrl.models.value.worker import ValueWorker

TASK_VALUES = "values"
TASK_VALUE_TRAIN = "value_train"
TASK_ADVANTAGES = "advantages"
#: Every field a PPO step writes: GRPO's train fields plus the critic's columns and the per-row rewards.
PPO_TRAIN_FIELDS: tuple[str, ...] = (*DP_TRAIN_FIELDS, VALUES, RETURNS, REWARDS)
PPO_CONSUMER_TASKS: tuple[str, ...] = (*TRAIN_CONSUMER_TASKS, TASK_VALUES, TASK_ADVANTAGES, TASK_VALUE_TRAIN)


class TQValue(Value):
    """`Value` whose inputs and per-token outputs live in the data plane (`dp_cfg` = `data_plane:` config).

    Build it after the `TQPolicy`: the policy's client bootstraps the store, this one and its workers attach.
    """

    worker_cls: type[ValueWorker] = TQValueWorker
    _group: WorkerGroup[TQValueWorker]

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
        self.dp_cfg = parsed
        self.tq_partition_id = tq_partition_id
        # attached (the policy bootstrapped the store), but in the driver: its bytes crossed the driver
        self.dp_client: DataPlaneClient = connect_driver_and_workers(self._group, parsed, bootstrap=False)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> bool:
        """Close the driver's client (errors become warnings), then shut the workers down."""
        close_quietly(self.dp_client)
        return super().shutdown()

    # ------------------------------------------------------------------ partition lifecycle
    def prepare_step(self, num_samples: int) -> None:
        """Register the step's partition with every PPO field (the policy's `prepare_step` knows only GRPO's)."""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"prepare_step: num_samples must be a positive int, got {num_samples!r}")
        self.dp_client.register_partition(
            self.tq_partition_id, list(PPO_TRAIN_FIELDS), num_samples, list(PPO_CONSUMER_TASKS), None
        )

    def discard_samples(self, keys: Sequence[str], partition_id: str) -> int:
        """Drop `keys` from the store; returns how many were present."""
        if isinstance(keys, str):
            raise TypeError("discard_samples takes a sequence of keys, not a single string")
        return self.dp_client.clear_samples(list(keys), partition_id)

    def finish_step(self, meta: KVBatchMeta) -> None:
        """Clear every key of the step's meta, then require the partition to be empty; names leaked keys."""
        self.discard_samples(meta.keys, meta.partition_id)
        leaked = list(self.dp_client.keys(meta.partition_id))
        if leaked:
            raise DataPlaneLeakError(
                f"partition {meta.partition_id!r} still holds {len(leaked)} keys after finish_step: "
                f"{format_keys(leaked)}; every minted key must be trained on or discarded with discard_samples"
            )

    # ------------------------------------------------------------------ driver-side column access
    def _stamp_pad_seqlen(self, meta: KVBatchMeta) -> None:
        """`extra_info[GLOBAL_FORWARD_PAD_SEQLEN]` (once): the width every reader pads to, as `TQPolicy` stamps it
        (the policy has no sequence-length rounding, so both compute round_up(max length, pad_to_multiple))."""
        if GLOBAL_FORWARD_PAD_SEQLEN in meta.extra_info or not meta.sequence_lengths:
            return
        multiple = int(meta.extra_info.get(PAD_TO_MULTIPLE, 1))
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = round_up(max(meta.sequence_lengths), multiple)

    def read_from_dataplane(self, meta: KVBatchMeta, *, select_fields: Sequence[str]) -> BatchedDataDict:
        """Fetch `select_fields` of `meta.keys` through the driver (tests, debugging), padded like the workers'."""
        _check_meta(meta, "read_from_dataplane")
        if isinstance(select_fields, str) or not select_fields:
            raise ValueError("read_from_dataplane: select_fields must be a non-empty list of field names")
        self._stamp_pad_seqlen(meta)
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        pads = {} if pad_id is None else {INPUT_IDS: pad_id}
        return read_columns(self.dp_client, meta, list(select_fields), pad_value_dict=pads)

    def write_to_dataplane(self, meta: KVBatchMeta, fields: Mapping[str, Any]) -> None:
        """Write driver columns under `meta.keys` (per-row `rewards`, `sample_mask`; per-token ones unpadded)."""
        _check_meta(meta, "write_to_dataplane")
        if not isinstance(fields, Mapping) or not fields:
            raise ValueError("write_to_dataplane: fields must be a non-empty mapping of name -> tensor")
        cols = pack_fields(fields, meta.sequence_lengths, TOKEN_ALIGNED_FIELDS | VALUE_TOKEN_FIELDS)
        self.dp_client.put_samples(meta.keys, meta.partition_id, cols)

    # ------------------------------------------------------------------ dispatch
    def _shards(self, meta: KVBatchMeta, fields: Sequence[str], task: str, batch_size: int | None) -> list[KVBatchMeta]:
        self._stamp_pad_seqlen(meta)
        sub = dataclasses.replace(meta, fields=list(fields), task_name=task)
        return shard_meta_for_dp(sub, self.dp_size, batch_size=batch_size)

    def get_values_from_meta(self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Any = None) -> None:
        """Critic values of `meta`'s rows; the workers write them to the store as `values` `[N, S]` (unpadded)."""
        _check_meta(meta, "get_values_from_meta")
        shards = self._shards(meta, VALUE_SEED_FIELDS, TASK_VALUES, None)
        with _timed(timer, "get_values/workers"):
            results = self._group.run_sharded(
                TQValueWorker.get_values_presharded, shards, micro_batch_size or self.value_batch_size
            )
        if any(r is not None for r in results):
            raise RuntimeError("get_values_presharded must write its result to the store and return None")

    def train_from_meta(
        self,
        meta: KVBatchMeta,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Any = None,
    ) -> dict[str, Any]:
        """`Value.train` on `meta`'s rows: `returns`, old `values` and both masks are read from the store by the
        workers (global batch k holds the same rows on every rank as in the legacy sharding). No clear here."""
        _check_meta(meta, "train_from_meta")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        self._check_train_sizes(meta.size, gbs, mbs, "train_from_meta")
        shards = self._shards(meta, VALUE_TRAIN_FIELDS, TASK_VALUE_TRAIN, gbs)
        with _timed(timer, "value_training/workers"):
            results = self._group.run_sharded(
                TQValueWorker.train_presharded, shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
            )
        return merge_value_train_results(results)

    def compute_advantages_from_meta(
        self, meta: KVBatchMeta, estimator: Any, *, logprob_fields: Sequence[str] = (), timer: Any = None
    ) -> dict[str, float]:
        """PPO advantages and returns of `meta`'s rows, computed on the workers from the stored `values`, masks and
        per-row `rewards` and written back as per-token columns; returns the `advantages/*`, `returns/mean`,
        `values/mean` metrics. One shard is one pass (bit-exact with the legacy estimator); several shards with
        whitening take two (raw + float64 moments, then whitening with the batch moments)."""
        _check_meta(meta, "compute_advantages_from_meta")
        shards = self._shards(meta, (), TASK_ADVANTAGES, None)
        lp = tuple(logprob_fields)
        from relayrl.algorithms.gae import combine_advantage_stats

        with _timed(timer, "advantage_calculation/workers"):
            live = sum(1 for s in shards if s.size)
            if live <= 1 or not getattr(estimator, "normalize_advantages", False):
                parts = self._group.run_sharded(
                    TQValueWorker.advantages_presharded, shards, estimator, mode=ADV_FULL, logprob_fields=lp
                )
                return combine_advantage_stats([p for p in parts if p is not None])
            raw = self._group.run_sharded(
                TQValueWorker.advantages_presharded, shards, estimator, mode=ADV_RAW, logprob_fields=lp
            )
            moments = [sum(r["moments"][i] for r in raw if r is not None) for i in range(3)]
            parts = self._group.run_sharded(
                TQValueWorker.advantages_presharded, shards, estimator, mode=ADV_WHITEN, moments=moments
            )
        return combine_advantage_stats([p for p in parts if p is not None])

    # ------------------------------------------------------------------ observability
    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]:
        """This driver client's `data_plane/*` counters plus `data_plane/workers/put_bytes` and `.../get_bytes`
        summed over the critic's workers (bytes that moved between the store and the workers, not the driver)."""
        out = self.dp_client.metrics(reset)
        workers = self._group.run_all(TQValueWorker.data_plane_metrics, reset)
        out["data_plane/workers/put_bytes"] = sum(m.get("data_plane/put/bytes", 0.0) for m in workers)
        out["data_plane/workers/get_bytes"] = sum(
            m.get("data_plane/get/bytes", 0.0) + m.get("data_plane/get_data/bytes", 0.0) for m in workers
        )
        return out


def _check_meta(meta: KVBatchMeta, what: str) -> None:
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"{what}: expected a KVBatchMeta, got {type(meta).__name__}")
    if meta.size == 0:
        raise ValueError(f"{what}: meta for partition {meta.partition_id!r} has no keys")
    if meta.sequence_lengths is None:
        raise ValueError(f"{what}: meta.sequence_lengths is required (per-token results are stored unpadded by it)")

"""TQValue: the data-plane counterpart of `Value`, driven by `KVBatchMeta`s instead of BatchedDataDicts.

It attaches to the store the `TQPolicy` bootstrapped (the policy owns the store; the critic is a second tenant of
the same partition): its workers fetch their DP slice of the keys with `shard_meta_for_dp`, compute, and write
`values` / `advantages` / `returns` back under the same keys, so the driver ships metadata and only waits.
`train_from_meta` returns what `Value.train` returns. Because PPO rows carry more columns than GRPO's, the critic
also owns the PPO partition schema: `prepare_step` registers every field the step writes and `finish_step` clears
the step's keys and fails on any key left behind. What it shares with `TQPolicy` is `models.tq_facade.TQFacade`.
It holds the `Value` it drives (`model`, built with `TQValueWorker`s) and forwards the rest of the value interface to
it explicitly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from relayrl.algorithms.gae import combine_advantage_stats
from relayrl.config import DataPlaneConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.metrics import merge_clients
from relayrl.data_plane.schema import (
    DP_TRAIN_FIELDS,
    GENERATION_SUPPORT,
    REWARDS,
    TOKEN_ALIGNED_FIELDS,
    TRAIN_CONSUMER_TASKS,
    TRAIN_PARTITION,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.facade_base import timed
from relayrl.models.tq_facade import TQFacade, check_meta, check_sample_count, require_written, validate_facade_args
from relayrl.models.value.interfaces import ValueInterface
from relayrl.models.value.lm_value import Value
from relayrl.models.value.tq_worker import (
    ADV_FULL,
    ADV_RAW,
    ADV_WHITEN,
    RETURNS,
    VALUE_SEED_FIELDS,
    VALUE_TOKEN_FIELDS,
    VALUE_TRAIN_FIELDS,
    VALUES,
    AdvantageEstimator,
    TQValueWorker,
)
from relayrl.utils.timer import Timer

TASK_VALUES = "values"
TASK_VALUE_TRAIN = "value_train"
TASK_ADVANTAGES = "advantages"
#: Every field a PPO step writes: GRPO's train fields plus the critic's columns and the per-row rewards.
PPO_TRAIN_FIELDS: tuple[str, ...] = (*DP_TRAIN_FIELDS, VALUES, RETURNS, REWARDS)
#: What a PPO step's partition declares: those, and the sampler's kept sets when sampling filters.
PPO_PARTITION_FIELDS: tuple[str, ...] = (*PPO_TRAIN_FIELDS, GENERATION_SUPPORT)
PPO_CONSUMER_TASKS: tuple[str, ...] = (*TRAIN_CONSUMER_TASKS, TASK_VALUES, TASK_ADVANTAGES, TASK_VALUE_TRAIN)


class TQValue(TQFacade[Value, TQValueWorker], ValueInterface):
    """A `Value` driven through the data plane (`dp_cfg` = `data_plane:` config): inputs and per-token outputs live
    in the store.

    Build it after the `TQPolicy`: the policy's client bootstraps the store, this one and its workers attach (in
    the driver: its bytes count as having crossed the driver). Constructed as
    `TQValue(*value_args, dp_cfg=..., tq_partition_id="train", **value_kwargs)`: the arguments of `Value`, which it
    builds with `TQValueWorker`s and holds as `model`.
    """

    bootstraps_store = False
    train_task = TASK_VALUE_TRAIN
    train_fields = VALUE_TRAIN_FIELDS
    train_meta_timers = (None, "value_training/workers")
    token_fields = TOKEN_ALIGNED_FIELDS | VALUE_TOKEN_FIELDS

    def __init__(
        self,
        *args: Any,
        dp_cfg: DataPlaneConfig | Mapping[str, Any],
        tq_partition_id: str = TRAIN_PARTITION,
        **kwargs: Any,
    ) -> None:
        parsed = validate_facade_args(dp_cfg, tq_partition_id)  # fail before any model is loaded
        super().__init__(Value(*args, worker_cls=TQValueWorker, **kwargs), parsed, tq_partition_id)

    # ------------------------------------------------------------------ partition lifecycle
    def prepare_step(self, num_samples: int) -> None:
        """Register the step's partition with every PPO field (the policy's `prepare_step` knows only GRPO's)."""
        check_sample_count(num_samples, "prepare_step")
        self.dp_client.register_partition(
            self.tq_partition_id, list(PPO_PARTITION_FIELDS), num_samples, list(PPO_CONSUMER_TASKS), None
        )

    # ------------------------------------------------------------------ dispatch (train_from_meta: TQFacade)
    def get_values_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> None:
        """Critic values of `meta`'s rows; the workers write them to the store as `values` `[N, S]` (unpadded)."""
        check_meta(meta, "get_values_from_meta")
        shards = self._meta_shards(meta, VALUE_SEED_FIELDS, TASK_VALUES, batch_size=None, stage="logprob_mb_tokens")
        with timed(timer, "get_values/workers"):
            results = self._group.run_sharded(
                TQValueWorker.get_values_presharded, shards, micro_batch_size or self.model.value_batch_size
            )
        require_written(results, "get_values_presharded")

    def compute_advantages_from_meta(
        self,
        meta: KVBatchMeta,
        estimator: AdvantageEstimator,
        *,
        logprob_fields: Sequence[str] = (),
        timer: Timer | None = None,
    ) -> dict[str, float]:
        """PPO advantages and returns of `meta`'s rows, computed on the workers from the stored `values`, masks and
        per-row `rewards` and written back as per-token columns; returns the `advantages/*`, `returns/mean`,
        `values/mean` metrics. One shard is one pass (bit-exact with the legacy estimator); several shards with
        whitening take two (raw + float64 moments, then whitening with the batch moments)."""
        check_meta(meta, "compute_advantages_from_meta")
        shards = self._meta_shards(meta, (), TASK_ADVANTAGES, batch_size=None, stage="logprob_mb_tokens")
        lp = tuple(logprob_fields)
        with timed(timer, "advantage_calculation/workers"):
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
        workers = self._worker_data_plane_metrics(reset)
        out["data_plane/workers/put_bytes"] = sum(m.get("data_plane/put/bytes", 0.0) for m in workers)
        out["data_plane/workers/get_bytes"] = sum(
            m.get("data_plane/get/bytes", 0.0) + m.get("data_plane/get_data/bytes", 0.0) for m in workers
        )
        out.update(merge_clients([out, *workers]))  # latency histograms of every critic client, for the step's merge
        return out

    # ------------------------------------------------------------------ the held Value (explicit pass-through)
    @property
    def value_batch_size(self) -> int:
        return self.model.value_batch_size

    def get_values(self, data: BatchedDataDict, timer: Timer | None = None) -> BatchedDataDict:
        return self.model.get_values(data, timer)

    def prepare_for_inference(self, *args: Any, **kwargs: Any) -> None:
        self.model.prepare_for_inference(*args, **kwargs)

    def finish_inference(self, *args: Any, **kwargs: Any) -> None:
        self.model.finish_inference(*args, **kwargs)

    def offload_to_cpu(self) -> None:
        """Move weights and optimizer state to the CPU (frees the accelerator for generation)."""
        self.model.offload_to_cpu()

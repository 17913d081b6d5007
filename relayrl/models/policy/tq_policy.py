"""TQPolicy: the data-plane counterpart of `Policy`, driven by `KVBatchMeta`s instead of BatchedDataDicts.

`train_from_meta` / `get_logprobs_from_meta` / `get_reference_policy_logprobs_from_meta` return what
`Policy.train` / `get_logprobs` / `get_reference_policy_logprobs` return, but take a meta naming per-sample keys
minted once at rollout (`SyncRolloutActor.rollout_to_tq`). Each dispatch splits the key list per DP rank with
`shard_meta_for_dp` (no new keys, same row assignment as the legacy sharding); every worker fetches its own rows,
computes, and writes results back under the same keys, so the driver ships metadata and only waits. The class also
owns the partition lifecycle: `prepare_step` registers the step's partition, `finish_step` clears it and fails
on any key left behind (a leak is an error, not a warning). What it shares with `TQValue` is
`models.tq_facade.TQFacade`. It holds the `Policy` it drives (`model`, built with `TQPolicyWorker`s) and forwards
the rest of the policy interface to it explicitly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.metrics import merge_clients, strip_sketches
from relayrl.data_plane.schema import (
    DP_TRAIN_FIELDS,
    GENERATION_SUPPORT,
    LP_SEED_FIELDS,
    PARTITION_FIELDS,
    TASK_PREV_LP,
    TASK_REF_LP,
    TASK_TRAIN,
    TRAIN_CONSUMER_TASKS,
    TRAIN_PARTITION,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import method_name
from relayrl.models.facade_base import merge_train_results, timed
from relayrl.models.policy.interfaces import ColocatablePolicyInterface
from relayrl.models.policy.lm_policy import Policy, WorkerCall
from relayrl.models.policy.tq_worker import SEQ_ERROR_FIELDS, TQPolicyWorker
from relayrl.models.tq_facade import (
    DataPlaneLeakError,
    TQFacade,
    check_meta,
    check_sample_count,
    require_written,
    validate_facade_args,
)
from relayrl.utils.timer import Timer

__all__ = ["DataPlaneLeakError", "TQPolicy"]


def _aggregate_train_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank train results → one dict, exactly as `Policy.train` merges them (`merge_train_results`)."""
    return merge_train_results(results)


class _LogprobPass(Protocol):
    """A worker's log-prob write-back entry point (`TQPolicyWorker.get_*logprobs_presharded`)."""

    def __call__(self, worker: TQPolicyWorker, meta: KVBatchMeta, /, micro_batch_size: int | None = None) -> None: ...


class TQPolicy(TQFacade[Policy, TQPolicyWorker], ColocatablePolicyInterface):
    """A `Policy` driven through the data plane (`dp_cfg` = `data_plane:` config): bulk inputs and per-token outputs
    live in the store.

    The driver bootstraps the store after the workers exist, then every worker attaches with `bootstrap=False`
    (the `memory` backend: the driver's in-process store; `ray`: the named store actor, from any process).
    Constructed as `TQPolicy(*policy_args, dp_cfg=..., tq_partition_id="train", **policy_kwargs)`: the arguments
    of `Policy`, which it builds with `TQPolicyWorker`s and holds as `model`.
    """

    bootstraps_store = True
    train_task = TASK_TRAIN
    train_fields = DP_TRAIN_FIELDS
    optional_train_fields = (GENERATION_SUPPORT,)
    train_meta_timers = ("policy_training/shard_meta", "policy_training/submit_training_futures")

    def __init__(
        self,
        *args: Any,
        dp_cfg: DataPlaneConfig | Mapping[str, Any],
        tq_partition_id: str = TRAIN_PARTITION,
        **kwargs: Any,
    ) -> None:
        parsed = validate_facade_args(dp_cfg, tq_partition_id)  # fail before any model is loaded
        super().__init__(Policy(*args, worker_cls=TQPolicyWorker, **kwargs), parsed, tq_partition_id)

    # ------------------------------------------------------------------ partition lifecycle
    def prepare_step(self, num_samples: int, group_size: int | None = None) -> None:
        """Register this step's partition (`tq_partition_id`, reused every step) for every train field."""
        check_sample_count(num_samples, "prepare_step")
        self.dp_client.register_partition(
            self.tq_partition_id, list(PARTITION_FIELDS), num_samples, list(TRAIN_CONSUMER_TASKS), group_size
        )

    def prepare_val_partition(self, num_samples: int, *, partition_id: str = "val") -> None:
        """Register one validation batch's partition: same schema, one consumer task, no GRPO grouping."""
        check_sample_count(num_samples, "prepare_val_partition")
        self.dp_client.register_partition(partition_id, list(PARTITION_FIELDS), num_samples, [partition_id], None)

    def discard_samples(self, sample_ids: list[str], partition_id: str) -> None:  # type: ignore[override]
        """Drop `sample_ids` (keys minted at rollout) from partition `partition_id`: at the end of a step
        (`finish_step`) or mid-step for rows filtered out (dynamic sampling). Ids not in the store are ignored.

        The seed's signature; `TQFacade.discard_samples` (the critic's) also returns how many ids were present."""
        super().discard_samples(sample_ids, partition_id)

    # ------------------------------------------------------------------ dispatch (the rest: TQFacade)
    def _default_pad_multiple(self) -> int:
        return self.model.cfg.make_sequence_length_divisible_by

    def _logprob_dispatch(
        self,
        meta: KVBatchMeta,
        *,
        task_name: str,
        worker_method: _LogprobPass,
        timer_prefix: str,
        timer: Timer | None,
        common_kwargs: dict[str, Any],
    ) -> None:
        """Shard `meta` (log-prob seed fields only) over the DP ranks; each rank writes its result back."""
        check_meta(meta, task_name)
        seed = LP_SEED_FIELDS  # the policy's own pass filters with the sampler's kept sets when the rollout wrote them
        if task_name == TASK_PREV_LP and GENERATION_SUPPORT in (meta.fields or ()):
            seed = (*LP_SEED_FIELDS, GENERATION_SUPPORT)
        shards = self._meta_shards(
            meta,
            seed,
            task_name,
            batch_size=None,
            stage="logprob_mb_tokens",
            timer=timer,
            label=f"{timer_prefix}/shard_meta",
        )
        with timed(timer, f"{timer_prefix}/submit_futures"):
            results = self._group.run_sharded(worker_method, shards, **common_kwargs)
        require_written(results, method_name(worker_method))

    def get_logprobs_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> None:
        """Policy log-probs of `meta`'s rows; they land in the store as `prev_logprobs`."""
        self._logprob_dispatch(
            meta,
            task_name=TASK_PREV_LP,
            worker_method=TQPolicyWorker.get_logprobs_presharded,
            timer_prefix="get_logprobs",
            timer=timer,
            common_kwargs={"micro_batch_size": micro_batch_size or self.logprob_batch_size},
        )

    def get_reference_policy_logprobs_from_meta(
        self, meta: KVBatchMeta, micro_batch_size: int | None = None, timer: Timer | None = None
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
            common_kwargs={"micro_batch_size": micro_batch_size or self.logprob_batch_size},
        )

    def seq_logprob_error_from_meta(self, meta: KVBatchMeta, timer: Timer | None = None) -> BatchedDataDict:
        """Per-row `seq_logprob_error` and `num_loss_tokens` `[N]` (meta order), reduced on the workers from the
        stored `token_mask`, `sample_mask`, `prev_logprobs` and `generation_logprobs`: the driver gets 8 bytes a
        row instead of the per-token columns. Write the step's `sample_mask` first; the legacy reduction uses it."""
        check_meta(meta, "seq_logprob_error_from_meta")
        shards = self._meta_shards(
            meta,
            SEQ_ERROR_FIELDS,
            TASK_PREV_LP,
            batch_size=None,
            stage="logprob_mb_tokens",
            timer=timer,
            label="seq_logprob_error/shard_meta",
        )
        with timed(timer, "seq_logprob_error/submit_futures"):
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
        `data_plane/driver_bytes` (put+get by the driver) and `data_plane/driver_fraction_of_written`; latency
        percentiles and seconds over every client (`data_plane/all/<op>/ms_p50`, ..., `metrics.merge_clients`).
        """
        out = self.dp_client.metrics(reset)
        parts: list[Mapping[str, float]] = [out, *self._worker_data_plane_metrics(reset), *extra]
        written = sum(m.get("data_plane/put/bytes", 0.0) for m in parts)
        read = sum(m.get("data_plane/get/bytes", 0.0) + m.get("data_plane/get_data/bytes", 0.0) for m in parts)
        out["data_plane/all/put_bytes"] = written
        out["data_plane/all/get_bytes"] = read
        driver = out.get("data_plane/driver_bytes", 0.0)
        out["data_plane/driver_fraction_of_written"] = driver / written if written else 0.0
        out.update(merge_clients(parts))
        return strip_sketches(out)

    # ------------------------------------------------------------------ the held Policy (explicit pass-through)
    @property
    def has_reference(self) -> bool:
        return self.model.has_reference

    @property
    def logprob_batch_size(self) -> int:
        return self.model.logprob_batch_size

    @property
    def generation_source(self) -> Any:
        """Rank 0's worker (local executor only): what a colocated engine reads live weights from."""
        return self.model.generation_source

    @property
    def device(self) -> torch.device:
        return self.model.device

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict_for_refit()

    def get_logprobs(self, data: BatchedDataDict, timer: Timer | None = None) -> BatchedDataDict:
        return self.model.get_logprobs(data, timer)

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> BatchedDataDict:
        return self.model.get_reference_policy_logprobs(data, micro_batch_size, timer)

    def get_topk_logits(
        self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> BatchedDataDict:
        return self.model.get_topk_logits(data, k, micro_batch_size, timer)

    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]:
        return self.model.calibrate_qkv_fp8_scales(
            data, micro_batch_size=micro_batch_size, percentile=percentile, margin=margin, include_q=include_q
        )

    def prepare_for_lp_inference(self) -> None:
        self.model.prepare_for_lp_inference()

    def offload_before_refit(self) -> None:
        self.model.offload_before_refit()

    def offload_after_refit(self) -> None:
        self.model.offload_after_refit()

    def prepare_refit_info(self) -> dict[str, Any] | None:
        return self.model.prepare_refit_info()

    def refit_digests(self, keys: list[str]) -> dict[str, tuple[str, int, int]]:
        return self.model.refit_digests(keys)

    def generation_storage(self) -> set[int]:
        return self.model.generation_storage()

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[WorkerCall[bool]]:
        return self.model.init_collective(ip, port, world_size, train_world_size=train_world_size)

    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int, kv_scales: dict[str, float] | None = None
    ) -> list[WorkerCall[bool]]:
        return self.model.stream_weights_via_ipc_zmq(buffer_size_bytes, kv_scales)

    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> list[WorkerCall[bool]]:
        return self.model.broadcast_weights_for_collective(kv_scales)

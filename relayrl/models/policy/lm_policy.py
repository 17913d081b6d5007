"""Policy: the driver-side façade of a causal-LM policy (ColocatablePolicyInterface).

The façade validates batches, shards them across data-parallel workers, and reassembles results in input order;
`PolicyWorker` does the compute. What it shares with the value façade (worker group, train(), memory phases,
checkpoints) is `models.facade_base.ModelFacade`. Logprob-style passes use contiguous shards. On the local executor
the workers are objects in this process (one per rank), so a colocated generation engine can read the live
weights of rank 0 directly (`generation_source`).
"""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar, Unpack

import torch
from transformers import PreTrainedTokenizerBase

from relayrl.config import ClusterConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.executor import PendingResults, run_all_async
from relayrl.distributed.local import LocalWorkerGroup
from relayrl.models.facade_base import ROW_KEYS, ModelFacade, check_batch, rows_in_order, timed
from relayrl.models.policy.interfaces import ColocatablePolicyInterface
from relayrl.models.policy.worker import PolicyWorker
from relayrl.models.worker_base import ModelOptions
from relayrl.utils.timer import Timer

R = TypeVar("R")


class _SharedCall(Generic[R]):
    """A call started on every rank, waited for once however many handles ask (results cached)."""

    def __init__(self, pending: PendingResults[R]) -> None:
        self._pending = pending
        self._lock = threading.Lock()
        self._results: list[R] | None = None

    def result(self, timeout: float | None = None) -> list[R]:
        with self._lock:
            if self._results is None:
                self._results = self._pending.result(timeout)
            return self._results


class WorkerCall(Generic[R]):
    """One worker's handle on a call started on every rank (what the seed's `list[ray.ObjectRef]` holds one of per
    worker): `result()` waits and returns this worker's result. The ranks run the call together (a collective), so
    a handle resolves once the whole call has, with the group's failure handling (a dead or stuck rank is named)."""

    def __init__(self, call: _SharedCall[R], rank: int) -> None:
        self._call = call
        self.rank = rank

    def result(self, timeout: float | None = None) -> R:
        return self._call.result(timeout)[self.rank]


def per_worker(pending: PendingResults[R], world_size: int) -> list[WorkerCall[R]]:
    """One handle per worker (rank order) on a call `run_all_async` started on every rank."""
    shared = _SharedCall(pending)
    return [WorkerCall(shared, rank) for rank in range(world_size)]


class Policy(ModelFacade[PolicyWorker], ColocatablePolicyInterface):
    """A Hugging Face causal LM trained with RL losses, executed by one worker per data-parallel rank.

    `load_checkpoint` loads the live model only: the frozen reference model stays as it was built."""

    worker_cls: type[PolicyWorker] = PolicyWorker
    train_timer_label = "policy_training"
    cfg: PolicyConfig

    def __init__(
        self,
        config: PolicyConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        cluster: ClusterConfig | None = None,
        init_reference_model: bool = True,
        worker_cls: type[PolicyWorker] | None = None,
        **options: Unpack[ModelOptions],
    ) -> None:
        """`worker_cls` replaces `PolicyWorker` (a `TQPolicy` drives its policy with data-plane workers)."""
        self.has_reference = init_reference_model
        cfg = config if isinstance(config, PolicyConfig) else PolicyConfig.model_validate(config)
        super().__init__(
            cfg, tokenizer, cluster, worker_cls=worker_cls, init_reference_model=init_reference_model, **options
        )

    # ------------------------------------------------------------------ properties
    @property
    def logprob_batch_size(self) -> int:
        return self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size

    @property
    def generation_source(self) -> Any:
        """Rank 0's worker (`.model`: the live module, `.weights_version`: bumped per optimizer step); under LoRA its
        merged view (`PolicyWorker.generation_view`: a plain module with the adapters merged in)."""
        if not isinstance(self._group, LocalWorkerGroup):
            raise RuntimeError("generation_source is only available on the local executor (workers in-process)")
        return self._group.worker(0).generation_view

    def generation_storage(self) -> set[int]:
        """Rank 0's `PolicyWorker.generation_storage` (local executor only: data pointers mean nothing elsewhere)."""
        if not isinstance(self._group, LocalWorkerGroup):
            raise RuntimeError("generation_storage is only available on the local executor (workers in-process)")
        return self._group.worker(0).generation_storage()

    @property
    def device(self) -> torch.device:
        """The device rank 0 computes on (where a colocated engine should run)."""
        if isinstance(self._group, LocalWorkerGroup):
            return self._group.worker(0).device
        return torch.device(self._group.run_rank0(PolicyWorker.get_device))

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        """The live state dict of rank 0 (tensors share storage with the model: no copy)."""
        return self.state_dict()

    # ------------------------------------------------------------------ logprob-style passes
    def get_logprobs(self, data: BatchedDataDict, timer: Timer | None = None) -> BatchedDataDict:
        lp = self._row_pass("get_logprobs", data, timer, PolicyWorker.get_logprobs, "logprobs", self.logprob_batch_size)
        return BatchedDataDict(logprobs=lp)  # [B, S]

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> BatchedDataDict:
        if not self.has_reference:
            raise RuntimeError("reference log-probs requested but the policy was built with init_reference_model=False")
        mbs = micro_batch_size or self.logprob_batch_size
        what, method = "get_reference_policy_logprobs", PolicyWorker.get_reference_policy_logprobs
        ref = self._row_pass(what, data, timer, method, "reference_logprobs", mbs)
        return BatchedDataDict(reference_logprobs=ref)  # [B, S]

    def get_topk_logits(
        self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None, timer: Timer | None = None
    ) -> BatchedDataDict:
        check_batch(data, ROW_KEYS, "get_topk_logits")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"get_topk_logits: k must be a positive int, got {k!r}")
        mbs = micro_batch_size or self.logprob_batch_size
        with timed(timer, "get_topk_logits"):
            parts, unsorted = self._run_rows(data, PolicyWorker.get_topk_logits, k, mbs)
        return BatchedDataDict(
            topk_logits=rows_in_order(parts, "topk_logits", unsorted),  # [B, S-1, k]
            topk_indices=rows_in_order(parts, "topk_indices", unsorted),  # [B, S-1, k]
        )

    # ------------------------------------------------------------------ calibration
    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]:
        check_batch(data, ROW_KEYS, "calibrate_qkv_fp8_scales")
        if not 0 <= percentile <= 100:
            raise ValueError(f"calibrate_qkv_fp8_scales: percentile must be in [0, 100], got {percentile}")
        if margin <= 0:
            raise ValueError(f"calibrate_qkv_fp8_scales: margin must be positive, got {margin}")
        mbs = micro_batch_size or self.logprob_batch_size
        results = self._group.run_sharded(
            PolicyWorker.calibrate_qkv_fp8_scales, self._shards(data), mbs, percentile, margin, include_q
        )
        return results[0]  # identical on every rank after the cross-rank max

    # ------------------------------------------------------------------ memory phases (plus ModelFacade's)
    def prepare_for_lp_inference(self) -> None:
        self._group.run_all(PolicyWorker.prepare_for_lp_inference)

    def offload_before_refit(self) -> None:
        self._group.run_all(PolicyWorker.offload_before_refit)

    def offload_after_refit(self) -> None:
        self._group.run_all(PolicyWorker.offload_after_refit)

    # ------------------------------------------------------------------ weights in / out
    def prepare_refit_info(self) -> dict[str, Any] | None:
        return self._group.run_rank0(PolicyWorker.prepare_refit_info)

    def refit_digests(self, keys: list[str]) -> dict[str, tuple[str, int, int]]:
        """Refit verification's expected side: rank 0's digests under a generation engine's keys (every rank runs it:
        a sharded tensor is gathered by a collective; replicas hold the same weights)."""
        return self._group.run_all(PolicyWorker.refit_digests, keys)[0]

    # ------------------------------------------------------------------ separate generation workers
    # Each starts the call on every rank and returns at once with one handle per worker (rank order; `.result()`
    # -> that worker's result), so that the driver can run the generation side's matching call concurrently.
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[WorkerCall[bool]]:
        call = run_all_async(
            self._group, PolicyWorker.init_collective, ip, port, world_size, train_world_size=train_world_size
        )
        return per_worker(call, self.dp_size)

    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int, kv_scales: dict[str, float] | None = None
    ) -> list[WorkerCall[bool]]:
        call = run_all_async(self._group, PolicyWorker.stream_weights_via_ipc_zmq, buffer_size_bytes, kv_scales)
        return per_worker(call, self.dp_size)

    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> list[WorkerCall[bool]]:
        call = run_all_async(self._group, PolicyWorker.broadcast_weights_for_collective, kv_scales)
        return per_worker(call, self.dp_size)

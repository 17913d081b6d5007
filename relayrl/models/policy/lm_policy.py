"""Policy: the driver-side façade of a causal-LM policy (ColocatablePolicyInterface).

The façade validates batches, shards them across data-parallel workers, and reassembles results in input order;
`PolicyWorker` does the compute. Train batches are sharded with `shard_by_batch_size(dp, batch_size=gbs)` so
global batch k holds the same rows on every rank; logprob-style passes use contiguous shards. On the local executor
the workers are objects in this process (one per rank), so a colocated generation engine can read the live
weights of rank 0 directly (`generation_source`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import ClusterConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.executor import build_worker_group, run_all_async
from relayrl.distributed.interfaces import WorkerGroup
from relayrl.distributed.local import LocalWorkerGroup
from relayrl.models.policy.interfaces import ColocatablePolicyInterface
from relayrl.models.policy.worker import PolicyWorker
from relayrl.utils import device as dev

_LOGPROB_KEYS = ("input_ids", "input_lengths")
_TRAIN_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


def check_batch(data: BatchedDataDict, required: tuple[str, ...], what: str) -> int:
    """Validate a batch for `what`; returns its row count. Raises ValueError naming the offending key."""
    if not isinstance(data, dict):
        raise TypeError(f"{what}: expected a BatchedDataDict, got {type(data).__name__}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{what}: batch is missing required key(s) {missing}; it has {sorted(data)}")
    rows = BatchedDataDict(data).check_consistent()
    ids, lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        raise ValueError(f"{what}: input_ids must be an integer tensor [B, S], got {_describe(ids)}")
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError(f"{what}: input_lengths must be a tensor [B], got {_describe(lengths)}")
    seq = ids.shape[1]
    if rows and (int(lengths.max()) > seq or int(lengths.min()) < 0):
        raise ValueError(
            f"{what}: input_lengths must lie in [0, {seq}] (the padded length of input_ids); "
            f"got min {int(lengths.min())}, max {int(lengths.max())}"
        )
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] != seq:
            raise ValueError(f"{what}: {key} has sequence length {value.shape[1]} but input_ids has {seq}")
    return rows


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__


@contextlib.contextmanager
def _timed(timer: Any, label: str) -> Iterator[None]:
    """`timer.time(label)` when a timer is given (the trainer's Timer), else nothing."""
    if timer is None:
        yield
    else:
        with timer.time(label):
            yield


class Policy(ColocatablePolicyInterface):
    """A Hugging Face causal LM trained with RL losses, executed by one worker per data-parallel rank."""

    #: Worker class the group is built from (subclasses such as TQPolicy swap in a data-plane-aware worker).
    worker_cls: type[PolicyWorker] = PolicyWorker

    def __init__(
        self,
        config: PolicyConfig,
        tokenizer: Any,
        *,
        cluster: ClusterConfig | None = None,
        init_reference_model: bool = True,
        init_optimizer: bool = True,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        max_num_steps: int | None = None,
    ) -> None:
        self.cfg = config if isinstance(config, PolicyConfig) else PolicyConfig.model_validate(config)
        self.cluster = cluster if cluster is not None else ClusterConfig()
        dev.apply_runtime_settings(
            self.cluster.deterministic, self.cluster.torch_num_threads, self.cluster.retain_freed_memory
        )
        self.tokenizer = tokenizer
        self.has_reference = init_reference_model
        self.dp_size = self.cluster.num_nodes * self.cluster.workers_per_node
        self._group: WorkerGroup[PolicyWorker] = build_worker_group(
            self.worker_cls,
            self.cluster,
            config=self.cfg,
            tokenizer=tokenizer,
            device=self.cluster.device,
            init_reference_model=init_reference_model,
            init_optimizer=init_optimizer,
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            max_num_steps=max_num_steps,
        )

    # ------------------------------------------------------------------ properties
    @property
    def logprob_batch_size(self) -> int:
        return self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size

    @property
    def generation_source(self) -> PolicyWorker:
        """Rank 0's worker (`.model`: the live module, `.weights_version`: bumped per optimizer step)."""
        if not isinstance(self._group, LocalWorkerGroup):
            raise RuntimeError("generation_source is only available on the local executor (workers in-process)")
        return self._group.worker(0)

    @property
    def device(self) -> torch.device:
        """The device rank 0 computes on (where a colocated engine should run)."""
        if isinstance(self._group, LocalWorkerGroup):
            return self.generation_source.device
        return torch.device(self._group.run_rank0(PolicyWorker.get_device))

    @property
    def weights_version(self) -> int:
        return self._group.run_rank0(PolicyWorker.get_weights_version)

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        """The live state dict of rank 0 (tensors share storage with the model: no copy)."""
        return self._group.run_rank0(PolicyWorker.state_dict_for_refit)

    # ------------------------------------------------------------------ logprob-style passes
    def _shards(self, data: BatchedDataDict) -> list[BatchedDataDict]:
        return BatchedDataDict(data).shard_by_batch_size(self.dp_size, allow_uneven_shards=True)

    def get_logprobs(self, data: BatchedDataDict, timer: Any = None) -> BatchedDataDict:
        check_batch(data, _LOGPROB_KEYS, "get_logprobs")
        with _timed(timer, "get_logprobs"):
            parts = self._group.run_sharded(PolicyWorker.get_logprobs, self._shards(data), self.logprob_batch_size)
        return BatchedDataDict(logprobs=torch.cat([p["logprobs"] for p in parts]))  # [B, S]

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, timer: Any = None
    ) -> BatchedDataDict:
        if not self.has_reference:
            raise RuntimeError("reference log-probs requested but the policy was built with init_reference_model=False")
        check_batch(data, _LOGPROB_KEYS, "get_reference_policy_logprobs")
        mbs = micro_batch_size or self.logprob_batch_size
        with _timed(timer, "get_reference_policy_logprobs"):
            parts = self._group.run_sharded(PolicyWorker.get_reference_policy_logprobs, self._shards(data), mbs)
        return BatchedDataDict(reference_logprobs=torch.cat([p["reference_logprobs"] for p in parts]))  # [B, S]

    def get_topk_logits(
        self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None, timer: Any = None
    ) -> BatchedDataDict:
        check_batch(data, _LOGPROB_KEYS, "get_topk_logits")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"get_topk_logits: k must be a positive int, got {k!r}")
        mbs = micro_batch_size or self.logprob_batch_size
        with _timed(timer, "get_topk_logits"):
            parts = self._group.run_sharded(PolicyWorker.get_topk_logits, self._shards(data), k, mbs)
        return BatchedDataDict(
            topk_logits=torch.cat([p["topk_logits"] for p in parts]),  # [B, S-1, k]
            topk_indices=torch.cat([p["topk_indices"] for p in parts]),  # [B, S-1, k]
        )

    # ------------------------------------------------------------------ training
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Any = None,
    ) -> dict[str, Any]:
        """One optimizer step per `gbs` rows (micro-batches of `mbs` accumulate); one scheduler step per call."""
        rows = check_batch(data, _TRAIN_KEYS, "train")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        if rows == 0 or rows % gbs:
            raise ValueError(f"train: {rows} rows are not a positive multiple of the global batch size {gbs}")
        if gbs % self.dp_size or (gbs // self.dp_size) % mbs:
            raise ValueError(
                f"train: global batch {gbs} must split into {self.dp_size} data-parallel shards of whole "
                f"micro-batches of {mbs} rows"
            )
        shards: list[BatchedDataDict] = BatchedDataDict(data).shard_by_batch_size(self.dp_size, batch_size=gbs)
        with _timed(timer, "policy_training"):
            results = self._group.run_sharded(PolicyWorker.train, shards, loss_fn, eval_mode, gbs, mbs)
        merged: dict[str, list[Any]] = {}
        for res in results:  # per-micro-batch partial sums from every rank add up to the global values
            for key, values in res["all_mb_metrics"].items():
                merged.setdefault(key, []).extend(values)
        head = results[0]
        return {**head, "all_mb_metrics": merged}

    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]:
        check_batch(data, _LOGPROB_KEYS, "calibrate_qkv_fp8_scales")
        if not 0 <= percentile <= 100:
            raise ValueError(f"calibrate_qkv_fp8_scales: percentile must be in [0, 100], got {percentile}")
        if margin <= 0:
            raise ValueError(f"calibrate_qkv_fp8_scales: margin must be positive, got {margin}")
        mbs = micro_batch_size or self.logprob_batch_size
        results = self._group.run_sharded(
            PolicyWorker.calibrate_qkv_fp8_scales, self._shards(data), mbs, percentile, margin, include_q
        )
        return results[0]  # identical on every rank after the cross-rank max

    # ------------------------------------------------------------------ memory phases
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(PolicyWorker.prepare_for_training)

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(PolicyWorker.finish_training)

    def prepare_for_lp_inference(self) -> None:
        self._group.run_all(PolicyWorker.prepare_for_lp_inference)

    def offload_before_refit(self) -> None:
        self._group.run_all(PolicyWorker.offload_before_refit)

    def offload_after_refit(self) -> None:
        self._group.run_all(PolicyWorker.offload_after_refit)

    # ------------------------------------------------------------------ weights in / out
    def prepare_refit_info(self) -> dict[str, Any] | None:
        return self._group.run_rank0(PolicyWorker.prepare_refit_info)

    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """HF weights (+config) at weights_path; optimizer+scheduler state at optimizer_path; tokenizer too."""
        # every rank: fsdp2 gathers its sharded optimizer state collectively (rank 0 writes the files)
        self._group.run_all(PolicyWorker.save_checkpoint, weights_path, optimizer_path, tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load saved weights (and optimizer state) into the live model; the reference model is left as it is."""
        self._group.run_all(PolicyWorker.load_checkpoint, weights_path, optimizer_path)

    def shutdown(self) -> bool:
        return self._group.shutdown()

    # ------------------------------------------------------------------ separate generation workers
    # Each returns at once with one future (`.result()` -> per-rank results) so that the driver can run the
    # generation side's matching call concurrently (§5.8 / §5.9).
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        return [
            run_all_async(
                self._group, PolicyWorker.init_collective, ip, port, world_size, train_world_size=train_world_size
            )
        ]

    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int, kv_scales: dict[str, float] | None = None
    ) -> list[Any]:
        return [run_all_async(self._group, PolicyWorker.stream_weights_via_ipc_zmq, buffer_size_bytes, kv_scales)]

    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> list[Any]:
        return [run_all_async(self._group, PolicyWorker.broadcast_weights_for_collective, kv_scales)]

"""Value: the driver-side façade of the PPO critic (ValueInterface).

Mirrors `Policy`: it validates batches, shards them across data-parallel `ValueWorker`s and reassembles results in
input order. Train batches are sharded with `shard_by_batch_size(dp, batch_size=gbs)` so global batch k holds the
same rows on every rank; value passes use contiguous shards. Values are token-aligned and right-shifted
(V[:, t] = value of the state before token t, V[:, 0] = 0, 0 on padding), matching GAE's layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from relayrl.algorithms.interfaces import LossFunction
from relayrl.algorithms.value_loss import reduce_critic_metrics
from relayrl.config import ClusterConfig, ValueConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.executor import build_worker_group
from relayrl.distributed.interfaces import WorkerGroup
from relayrl.models.policy.lm_policy import check_batch
from relayrl.models.value.interfaces import ValueInterface
from relayrl.models.value.worker import ValueWorker
from relayrl.utils import device as dev

__all__ = ["Value", "ValueConfig"]

_VALUE_KEYS = ("input_ids", "input_lengths")
_TRAIN_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


def coerce_value_config(config: Any) -> ValueConfig:
    """A ValueConfig from itself, a dict, or any pydantic config sharing its keys (e.g. a PolicyConfig)."""
    if isinstance(config, ValueConfig):
        return config
    if isinstance(config, dict):
        return ValueConfig.model_validate(config)
    if hasattr(config, "model_dump"):
        dumped = config.model_dump()
        return ValueConfig.model_validate({k: v for k, v in dumped.items() if k in ValueConfig.model_fields})
    raise TypeError(f"value config must be a ValueConfig, a PolicyConfig or a dict, got {type(config).__name__}")


@contextlib.contextmanager
def _timed(timer: Any, label: str) -> Iterator[None]:
    """`timer.time(label)` when a timer is given (the trainer's Timer), else nothing."""
    if timer is None:
        yield
    else:
        with timer.time(label):
            yield


def merge_value_train_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank train results -> one: rank 0's values plus every rank's micro-batch metrics, reduced to `metrics`
    (per-micro-batch partial sums from every rank add up to the global values)."""
    if not results:
        raise ValueError("merge_value_train_results: no worker results")
    merged: dict[str, list[Any]] = {}
    for res in results:
        for key, values in res["all_mb_metrics"].items():
            merged.setdefault(key, []).extend(values)
    head = results[0]
    metrics = reduce_critic_metrics(merged)
    if head["grad_norm"] is not None:
        metrics["grad_norm"] = float(head["grad_norm"])
    return {**head, "all_mb_metrics": merged, "metrics": metrics}


class Value(ValueInterface):
    """A causal-LM backbone with a scalar head, trained as a critic, executed by one worker per data-parallel rank.

    `config` is a `ValueConfig`, a dict of its keys, or a `PolicyConfig` (its shared keys are used).
    """

    #: Worker class the worker group is built from (the data-plane critic swaps in its own).
    worker_cls: type[ValueWorker] = ValueWorker

    def __init__(
        self,
        config: ValueConfig | Any,
        tokenizer: Any,
        *,
        cluster: ClusterConfig | None = None,
        init_optimizer: bool = True,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        max_num_steps: int | None = None,
    ) -> None:
        self.cfg = coerce_value_config(config)
        self.cluster = cluster if cluster is not None else ClusterConfig()
        dev.apply_runtime_settings(
            self.cluster.deterministic, self.cluster.torch_num_threads, self.cluster.retain_freed_memory
        )
        self.tokenizer = tokenizer
        self.dp_size = self.cluster.num_nodes * self.cluster.workers_per_node
        self._group: WorkerGroup[ValueWorker] = build_worker_group(
            self.worker_cls,
            self.cluster,
            config=self.cfg,
            tokenizer=tokenizer,
            device=self.cluster.device,
            init_optimizer=init_optimizer,
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            max_num_steps=max_num_steps,
        )

    # ------------------------------------------------------------------ properties
    @property
    def value_batch_size(self) -> int:
        return self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size

    @property
    def weights_version(self) -> int:
        """Optimizer steps taken (restored from an optimizer checkpoint)."""
        return self._group.run_rank0(ValueWorker.get_weights_version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's live state dict (backbone `model.*` and head `score.*`; tensors share storage, no copy)."""
        return self._group.run_rank0(ValueWorker.state_dict)

    # ------------------------------------------------------------------ inference
    def get_values(self, data: BatchedDataDict, timer: Any = None) -> BatchedDataDict:
        """{"values": float32 [B, S] on CPU}: V[:, 0] = 0, V[:, t] = head[:, t-1], 0 for t >= input_lengths."""
        check_batch(data, _VALUE_KEYS, "get_values")
        shards = BatchedDataDict(data).shard_by_batch_size(self.dp_size, allow_uneven_shards=True)
        with _timed(timer, "get_values"):
            parts = self._group.run_sharded(ValueWorker.get_values, shards, self.value_batch_size)
        return BatchedDataDict(values=torch.cat([p["values"] for p in parts]))  # [B, S]

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
        """One optimizer step per `gbs` rows (micro-batches of `mbs` accumulate); one scheduler step per call.

        `loss_fn(values [b, S] with grad, micro_batch, global_valid_seqs, global_valid_toks)`. Returns `loss`
        [num_global_batches], `grad_norm` (pre-clip, last global batch; None in eval mode), `lr`, `all_mb_metrics`
        (per micro-batch lists from every rank) and `metrics`: those reduced by `reduce_critic_metrics`
        (`explained_var`, `vf_clipfrac`, `values_mean`, `returns_mean`, ... with MseValueLossFn) plus `grad_norm`.
        """
        rows = check_batch(data, _TRAIN_KEYS, "train")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        self._check_train_sizes(rows, gbs, mbs, "train")
        shards: list[BatchedDataDict] = BatchedDataDict(data).shard_by_batch_size(self.dp_size, batch_size=gbs)
        with _timed(timer, "value_training"):
            results = self._group.run_sharded(ValueWorker.train, shards, loss_fn, eval_mode, gbs, mbs)
        return merge_value_train_results(results)

    def _check_train_sizes(self, rows: int, gbs: int, mbs: int, what: str) -> None:
        if rows == 0 or rows % gbs:
            raise ValueError(f"{what}: {rows} rows are not a positive multiple of the global batch size {gbs}")
        if gbs % self.dp_size or (gbs // self.dp_size) % mbs:
            raise ValueError(
                f"{what}: global batch {gbs} must split into {self.dp_size} data-parallel shards of whole "
                f"micro-batches of {mbs} rows"
            )

    # ------------------------------------------------------------------ memory phases
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(ValueWorker.prepare_for_training)

    def prepare_for_inference(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(ValueWorker.prepare_for_inference)

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(ValueWorker.finish_training)

    def finish_inference(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(ValueWorker.finish_inference)

    def offload_to_cpu(self) -> None:
        """Move weights and optimizer state to the CPU (frees the accelerator for generation)."""
        self._group.run_all(ValueWorker.offload_to_cpu)

    # ------------------------------------------------------------------ weights in / out
    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Backbone (HF directory) + head at weights_path; optimizer+scheduler at optimizer_path; tokenizer too."""
        # every rank: fsdp2 gathers its sharded optimizer state collectively (rank 0 writes the files)
        self._group.run_all(ValueWorker.save_checkpoint, weights_path, optimizer_path, tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load a saved critic (and optimizer state) into the live model of every rank."""
        self._group.run_all(ValueWorker.load_checkpoint, weights_path, optimizer_path)

    def shutdown(self) -> bool:
        return self._group.shutdown()

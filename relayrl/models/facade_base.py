"""What the policy and value façades share: the driver side of a group of `ModelWorker`s.

A façade validates batches, shards them across the data-parallel workers and reassembles results in input order;
the workers compute. `ModelFacade` holds the machinery `Policy` and `Value` run the same way: building the worker
group from the `cluster` block, train() (global batch k holds the same rows on every rank), memory phases,
checkpoints and shutdown. Subclasses add their own passes (log-probs, values) and name their worker class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import ClusterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.executor import build_worker_group
from relayrl.distributed.interfaces import WorkerGroup
from relayrl.models.microbatch import plan_shards
from relayrl.models.worker_base import ModelConfig, ModelWorker
from relayrl.utils import device as dev
from relayrl.utils.timer import Timer

W = TypeVar("W", bound=ModelWorker)
P = ParamSpec("P")

#: What every batch of an inference pass, and every train batch, must hold.
ROW_KEYS = ("input_ids", "input_lengths")
TRAIN_KEYS = (*ROW_KEYS, "token_mask", "sample_mask")


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


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__


@contextlib.contextmanager
def timed(timer: Timer | None, label: str | None) -> Iterator[None]:
    """`timer.time(label)` when a timer and a label are given (the trainer's Timer), else nothing."""
    if timer is None or label is None:
        yield
    else:
        with timer.time(label):
            yield


def rows_in_order(parts: list[BatchedDataDict], key: str, unsorted: list[int] | None) -> torch.Tensor:
    """The ranks' `key` results concatenated in rank order, then put back in input order by `unsorted`."""
    out = torch.cat([p[key] for p in parts])
    return out if unsorted is None else out.index_select(0, torch.tensor(unsorted, dtype=torch.long))


def merge_train_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank train results -> one: rank 0's values (losses and grad norm are already global after the workers'
    all-reduce) and every rank's per-micro-batch metrics (partial sums that add up to the global values)."""
    if not results:
        raise ValueError("merge_train_results: no worker results to merge")
    merged: dict[str, list[Any]] = {}
    for res in results:
        for key, values in res["all_mb_metrics"].items():
            merged.setdefault(key, []).extend(values)
    return {**results[0], "all_mb_metrics": merged}


def check_train_sizes(rows: int, gbs: int, mbs: int, dp_size: int, what: str) -> None:
    """`rows` split into whole global batches of `gbs`, each into `dp_size` shards of whole micro-batches of `mbs`."""
    if rows == 0 or rows % gbs:
        raise ValueError(f"{what}: {rows} rows are not a positive multiple of the global batch size {gbs}")
    if gbs % dp_size or (gbs // dp_size) % mbs:
        raise ValueError(
            f"{what}: global batch {gbs} must split into {dp_size} data-parallel shards of whole "
            f"micro-batches of {mbs} rows"
        )


class ModelFacade(Generic[W]):
    """Driver side of one worker per data-parallel rank of a trainable model (`W`: the worker class)."""

    #: Worker class the group is built from (data-plane subclasses swap in a data-plane-aware worker).
    worker_cls: type[W]
    #: Timer label around a train() dispatch.
    train_timer_label: ClassVar[str] = "training"

    cfg: ModelConfig
    _group: WorkerGroup[W]

    def __init__(
        self,
        config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        cluster: ClusterConfig | None,
        *,
        worker_cls: type[W] | None = None,
        **worker_kwargs: object,
    ) -> None:
        if worker_cls is not None:  # a data-plane façade drives this one with its data-plane-aware workers
            self.worker_cls = worker_cls
        self.cfg = config
        self.cluster = cluster if cluster is not None else ClusterConfig()
        dev.apply_runtime_settings(
            self.cluster.deterministic, self.cluster.torch_num_threads, self.cluster.retain_freed_memory
        )
        self.tokenizer = tokenizer
        self.dp_size = self.cluster.num_nodes * self.cluster.workers_per_node
        self._group = build_worker_group(
            self.worker_cls,
            self.cluster,
            config=self.cfg,
            tokenizer=tokenizer,
            device=self.cluster.device,
            **worker_kwargs,
        )

    # ------------------------------------------------------------------ properties
    @property
    def worker_group(self) -> WorkerGroup[W]:
        """The group of one worker per data-parallel rank this façade dispatches to."""
        return self._group

    @property
    def weights_version(self) -> int:
        """Optimizer steps taken (restored from an optimizer checkpoint)."""
        return self._group.run_rank0(ModelWorker.get_weights_version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's live state dict (tensors share storage with the model: no copy)."""
        return self._group.run_rank0(ModelWorker.state_dict)

    def host_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's state dict in host memory: what a Ray driver receives (never a device tensor)."""
        return self._group.run_rank0(ModelWorker.host_state_dict)

    # ------------------------------------------------------------------ inference passes
    def _shards(self, data: BatchedDataDict) -> list[BatchedDataDict]:
        """Contiguous row blocks, one per rank (inference passes)."""
        return BatchedDataDict(data).shard_by_batch_size(self.dp_size, allow_uneven_shards=True)

    def _run_rows(
        self,
        data: BatchedDataDict,
        method: Callable[Concatenate[W, BatchedDataDict, P], BatchedDataDict],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> tuple[list[BatchedDataDict], list[int] | None]:
        """`method` on every rank's rows of an inference pass: (per-rank results, the inverse permutation that puts
        their concatenation back in input order, None when it already is). Contiguous blocks, or under sequence
        packing / dynamic batching the planner's balanced shards, each carrying its micro-batch plan."""
        planned = plan_shards(data, self.dp_size, self.cfg, "logprob_mb_tokens", None)
        shards, unsorted = (self._shards(data), None) if planned is None else planned
        return self._group.run_sharded(method, shards, *args, **kwargs), unsorted

    def _row_pass(
        self,
        what: str,
        data: BatchedDataDict,
        timer: Timer | None,
        method: Callable[Concatenate[W, BatchedDataDict, P], BatchedDataDict],
        key: str,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> torch.Tensor:
        """`method` on contiguous row blocks of `data` (one per rank); its `key` results, rows in input order."""
        check_batch(data, ROW_KEYS, what)
        with timed(timer, what):
            parts, unsorted = self._run_rows(data, method, *args, **kwargs)
        return rows_in_order(parts, key, unsorted)

    # ------------------------------------------------------------------ training
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
        """One optimizer step per `gbs` rows (micro-batches of `mbs` accumulate); one scheduler step per call."""
        rows = check_batch(data, TRAIN_KEYS, "train")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        check_train_sizes(rows, gbs, mbs, self.dp_size, "train")
        planned = plan_shards(data, self.dp_size, self.cfg, "train_mb_tokens", gbs)  # packing / dynamic batching
        shards: list[BatchedDataDict] = (
            BatchedDataDict(data).shard_by_batch_size(self.dp_size, batch_size=gbs)
            if planned is None
            else [*planned[0]]
        )
        with timed(timer, self.train_timer_label):
            results = self._group.run_sharded(ModelWorker.train, shards, loss_fn, eval_mode, gbs, mbs)
        return self.merge_results(results)

    def merge_results(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Per-rank train results -> the one `train` returns (a data-plane façade merges its own the same way)."""
        return merge_train_results(results)

    # ------------------------------------------------------------------ memory phases
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(ModelWorker.prepare_for_training)

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(ModelWorker.finish_training)

    # ------------------------------------------------------------------ weights in / out
    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Weights at weights_path; optimizer+scheduler state at optimizer_path; the tokenizer at tokenizer_path."""
        # every rank: fsdp2 gathers its sharded optimizer state collectively (rank 0 writes the files)
        self._group.run_all(ModelWorker.save_checkpoint, weights_path, optimizer_path, tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load saved weights (and optimizer state) into the live model of every rank."""
        self._group.run_all(ModelWorker.load_checkpoint, weights_path, optimizer_path)

    def shutdown(self) -> bool:
        return self._group.shutdown()

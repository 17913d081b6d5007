"""Value: the driver-side façade of the PPO critic (ValueInterface).

Like `Policy` (both are `models.facade_base.ModelFacade`s) it validates batches, shards them across data-parallel
`ValueWorker`s and reassembles results in input order; value passes use contiguous shards. Values are token-aligned
and right-shifted (V[:, t] = value of the state before token t, V[:, 0] = 0, 0 on padding), matching GAE's layout.
"""

from __future__ import annotations

from typing import Any, Unpack

from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from relayrl.algorithms.value_loss import reduce_critic_metrics
from relayrl.config import ClusterConfig, ValueConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.facade_base import ModelFacade, merge_train_results
from relayrl.models.value.interfaces import ValueInterface
from relayrl.models.value.worker import ValueWorker
from relayrl.models.worker_base import ModelOptions
from relayrl.utils.timer import Timer

__all__ = ["Value", "ValueConfig"]


def coerce_value_config(config: ValueConfig | BaseModel | dict[str, Any]) -> ValueConfig:
    """A ValueConfig from itself, a dict, or any pydantic config sharing its keys (e.g. a PolicyConfig)."""
    if isinstance(config, ValueConfig):
        return config
    if isinstance(config, dict):
        return ValueConfig.model_validate(config)
    if hasattr(config, "model_dump"):
        dumped = config.model_dump()
        return ValueConfig.model_validate({k: v for k, v in dumped.items() if k in ValueConfig.model_fields})
    raise TypeError(f"value config must be a ValueConfig, a PolicyConfig or a dict, got {type(config).__name__}")


def merge_value_train_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank train results -> one: rank 0's values plus every rank's micro-batch metrics, reduced to `metrics`
    (per-micro-batch partial sums from every rank add up to the global values)."""
    out = merge_train_results(results)
    metrics = reduce_critic_metrics(out["all_mb_metrics"])
    if out["grad_norm"] is not None:
        metrics["grad_norm"] = float(out["grad_norm"])
    return {**out, "metrics": metrics}


class Value(ModelFacade[ValueWorker], ValueInterface):
    """A causal-LM backbone with a scalar head, trained as a critic, executed by one worker per data-parallel rank.

    `config` is a `ValueConfig`, a dict of its keys, or a `PolicyConfig` (its shared keys are used). `train` returns,
    besides `loss`, `grad_norm` (pre-clip, last global batch; None in eval mode), `lr` and `all_mb_metrics`,
    `metrics`: the micro-batch metrics reduced by `reduce_critic_metrics` (`explained_var`, `vf_clipfrac`,
    `values_mean`, `returns_mean`, ... with MseValueLossFn) plus `grad_norm`.
    """

    worker_cls: type[ValueWorker] = ValueWorker
    train_timer_label = "value_training"
    cfg: ValueConfig

    def __init__(
        self,
        config: ValueConfig | BaseModel | dict[str, Any],
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        cluster: ClusterConfig | None = None,
        worker_cls: type[ValueWorker] | None = None,
        **options: Unpack[ModelOptions],
    ) -> None:
        """`worker_cls` replaces `ValueWorker` (a `TQValue` drives its critic with data-plane workers)."""
        super().__init__(coerce_value_config(config), tokenizer, cluster, worker_cls=worker_cls, **options)

    # ------------------------------------------------------------------ properties
    @property
    def value_batch_size(self) -> int:
        return self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size

    # ------------------------------------------------------------------ inference
    def get_values(self, data: BatchedDataDict, timer: Timer | None = None) -> BatchedDataDict:
        """{"values": float32 [B, S] on CPU}: V[:, 0] = 0, V[:, t] = head[:, t-1], 0 for t >= input_lengths."""
        values = self._row_pass("get_values", data, timer, ValueWorker.get_values, "values", self.value_batch_size)
        return BatchedDataDict(values=values)  # [B, S]

    def merge_results(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        return merge_value_train_results(results)

    # ------------------------------------------------------------------ memory phases (plus ModelFacade's)
    def prepare_for_inference(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(ValueWorker.prepare_for_inference)

    def finish_inference(self, *args: Any, **kwargs: Any) -> None:
        self._group.run_all(ValueWorker.finish_inference)

    def offload_to_cpu(self) -> None:
        """Move weights and optimizer state to the CPU (frees the accelerator for generation)."""
        self._group.run_all(ValueWorker.offload_to_cpu)

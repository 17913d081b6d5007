"""TQPolicyWorker: a `PolicyWorker` that takes its batch from the data plane instead of from the driver.

Each `*_presharded` entrypoint receives only a small `KVBatchMeta` naming this rank's keys. The worker fetches
those rows from the store (padded to the batch-wide width stamped by the driver), runs the ordinary
`PolicyWorker` computation, and writes per-token results back under the same keys, leader rank only. Only
metadata and training statistics travel back to the driver.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from relayrl.algorithms.interfaces import LossFunction
from relayrl.algorithms.logprob_error import per_sequence_logprob_error
from relayrl.config import DataPlaneConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.schema import (
    ADVANTAGES,
    GENERATION_LOGPROBS,
    PREV_LOGPROBS,
    REFERENCE_POLICY_LOGPROBS,
    SAMPLE_MASK,
    TOKEN_MASK,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.policy.worker import PolicyWorker
from relayrl.models.worker_data_plane import WorkerDataPlane

#: Train inputs a step may skip. The legacy trainer then trains on zeros of the shape of `generation_logprobs`,
#: so a missing one is filled the same way.
ZERO_FILLED_WHEN_SKIPPED: tuple[str, ...] = (PREV_LOGPROBS, REFERENCE_POLICY_LOGPROBS)
#: What the per-sequence log-prob error reduction reads.
SEQ_ERROR_FIELDS: tuple[str, ...] = (TOKEN_MASK, SAMPLE_MASK, PREV_LOGPROBS, GENERATION_LOGPROBS)


class TQPolicyWorker(PolicyWorker):
    """One data-parallel rank of a `TQPolicy`: a `PolicyWorker` holding its store connection (`data_plane`, a
    `WorkerDataPlane`, built on first use; `setup_data_plane` attaches it)."""

    @functools.cached_property
    def data_plane(self) -> WorkerDataPlane:
        return WorkerDataPlane(self.cfg, self.tokenizer)

    # ------------------------------------------------------------------ DataPlaneWorker entry points
    def setup_data_plane(self, cfg: DataPlaneConfig | Mapping[str, Any]) -> None:
        """Attach to the driver's store (idempotent; the driver built it with `bootstrap=True`)."""
        self.data_plane.attach(cfg)

    def train_presharded(
        self, meta: KVBatchMeta, loss_fn: LossFunction, eval_mode: bool, gbs: int, mbs: int
    ) -> dict[str, Any]:
        """Fetch this rank's training rows (`meta.fields`, completed by `complete_train_batch`), then `train`."""
        return self.train(self.data_plane.train_rows(meta, complete_train_batch), loss_fn, eval_mode, gbs, mbs)

    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]:
        """This rank's client counters (`data_plane/*`), so the driver can total the bytes every client moved."""
        return self.data_plane.metrics(reset)

    # ------------------------------------------------------------------ logprob-style passes
    def get_logprobs_presharded(self, meta: KVBatchMeta, micro_batch_size: int | None = None) -> None:
        """Policy log-probs of this rank's keys, written back as `prev_logprobs`. Returns None."""
        self.data_plane.write_back_pass(meta, self.get_logprobs, micro_batch_size, "logprobs", PREV_LOGPROBS)

    def get_reference_policy_logprobs_presharded(self, meta: KVBatchMeta, micro_batch_size: int | None = None) -> None:
        """Reference-model log-probs of this rank's keys, written back as `reference_policy_logprobs`."""
        self.data_plane.write_back_pass(
            meta, self.get_reference_policy_logprobs, micro_batch_size, "reference_logprobs", REFERENCE_POLICY_LOGPROBS
        )

    # ------------------------------------------------------------------ per-row reductions
    def seq_logprob_error_presharded(self, meta: KVBatchMeta) -> dict[str, torch.Tensor]:
        """Per-sequence train/generation log-prob error of this rank's rows, reduced here so that only two
        floats a row (not three per-token columns) travel to the driver."""
        if meta.size == 0:
            return {"seq_logprob_error": torch.zeros(0), "num_loss_tokens": torch.zeros(0)}
        data = self.data_plane.fetch(meta, SEQ_ERROR_FIELDS)
        seq_err, num_tokens = per_sequence_logprob_error(
            data[TOKEN_MASK], data[SAMPLE_MASK], data[PREV_LOGPROBS], data[GENERATION_LOGPROBS]
        )
        return {"seq_logprob_error": seq_err, "num_loss_tokens": num_tokens}


def complete_train_batch(data: BatchedDataDict) -> BatchedDataDict:
    """Bring a fetched train batch to the legacy trainer's layout.

    - per-row `advantages` `[n]` (the GRPO estimator's advantage is one value per sequence, stored as 4 bytes a
      row instead of a per-token column) are broadcast to `[n, W]`, exactly the legacy zero-stride expansion;
    - `prev_logprobs` / `reference_policy_logprobs` the step skipped become zeros like `generation_logprobs`.
    """
    adv = data.get(ADVANTAGES)
    if isinstance(adv, torch.Tensor) and adv.dim() == 1:
        if TOKEN_MASK not in data:
            raise ValueError("per-row advantages need token_mask in the fetched fields to know the sequence width")
        data[ADVANTAGES] = adv.unsqueeze(-1).expand(-1, data[TOKEN_MASK].shape[1])  # [n, W]
    for name in ZERO_FILLED_WHEN_SKIPPED:
        if name not in data:
            if GENERATION_LOGPROBS not in data:
                raise ValueError(f"train batch lacks both '{name}' and '{GENERATION_LOGPROBS}' to zero-fill it from")
            data[name] = torch.zeros_like(data[GENERATION_LOGPROBS])  # [n, W]
    return data

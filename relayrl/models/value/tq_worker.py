"""TQValueWorker: a `ValueWorker` that takes its rows from the data plane instead of from the driver.

Each `*_presharded` entrypoint receives only a `KVBatchMeta` naming this rank's keys. The worker fetches those rows
(padded to the batch-wide width the driver stamped), runs the ordinary `ValueWorker` computation, and writes
per-token results (`values`, `advantages`, `returns`) back under the same keys, replica leader only. Only
metadata, training statistics and a handful of floats travel back to the driver.

GAE runs here too: it needs the values this worker just wrote, the masks and the per-row rewards, all already in
the store, and it is row-local except for the optional whitening (see `relayrl.algorithms.gae`, sharded GAE).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, TypeAlias

import torch

from relayrl.algorithms.gae import (
    GeneralizedAdvantageEstimator,
    RawRewardAdvantageEstimator,
    advantage_moments,
    shard_advantage_stats,
    whiten_with_moments,
    without_normalization,
)
from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import DataPlaneConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.data_plane.schema import (
    ADVANTAGES,
    INPUT_IDS,
    INPUT_LENGTHS,
    PREV_LOGPROBS,
    REFERENCE_POLICY_LOGPROBS,
    REWARDS,
    SAMPLE_MASK,
    TOKEN_MASK,
)
from relayrl.models.value.worker import ValueWorker
from relayrl.models.worker_data_plane import WorkerDataPlane

VALUES = "values"
RETURNS = "returns"
#: What a value pass fetches.
VALUE_SEED_FIELDS: tuple[str, ...] = (INPUT_IDS, INPUT_LENGTHS)
#: What a critic update fetches (MseValueLossFn reads returns, old values and both masks).
VALUE_TRAIN_FIELDS: tuple[str, ...] = (INPUT_IDS, INPUT_LENGTHS, TOKEN_MASK, SAMPLE_MASK, RETURNS, VALUES)
#: What the advantage pass fetches (plus the two logprob columns when the KL is in the reward).
ADVANTAGE_FIELDS: tuple[str, ...] = (TOKEN_MASK, SAMPLE_MASK, VALUES, REWARDS)
#: Per-token columns the critic adds to the store (written unpadded by sequence length).
VALUE_TOKEN_FIELDS: frozenset[str] = frozenset({VALUES, RETURNS})

#: The PPO estimators the advantage pass runs.
AdvantageEstimator: TypeAlias = GeneralizedAdvantageEstimator | RawRewardAdvantageEstimator
#: Advantage-pass modes: the whole estimator on this shard; raw advantages + moments; whitening with moments.
ADV_FULL, ADV_RAW, ADV_WHITEN = "full", "raw", "whiten"


class TQValueWorker(ValueWorker):
    """One data-parallel rank of a `TQValue`: a `ValueWorker` holding its store connection (`data_plane`, a
    `WorkerDataPlane`, built on first use; `setup_data_plane` attaches it)."""

    @functools.cached_property
    def data_plane(self) -> WorkerDataPlane:
        return WorkerDataPlane(self.cfg, self.tokenizer)

    # ------------------------------------------------------------------ DataPlaneWorker entry points
    def setup_data_plane(self, cfg: DataPlaneConfig | Mapping[str, Any]) -> None:
        """Attach to the store the policy's driver bootstrapped (idempotent)."""
        self.data_plane.attach(cfg)

    def train_presharded(
        self, meta: KVBatchMeta, loss_fn: LossFunction, eval_mode: bool, gbs: int, mbs: int
    ) -> dict[str, Any]:
        """Fetch this rank's training rows (`meta.fields`), then run the ordinary `train`; returns its result."""
        return self.train(self.data_plane.train_rows(meta), loss_fn, eval_mode, gbs, mbs)

    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]:
        """This rank's client counters (`data_plane/*`), so the driver can total the bytes every client moved."""
        return self.data_plane.metrics(reset)

    # ------------------------------------------------------------------ values
    def get_values_presharded(self, meta: KVBatchMeta, micro_batch_size: int | None = None) -> None:
        """Critic values of this rank's keys, written back as the per-token `values` column. Returns None."""
        self.data_plane.write_back_pass(meta, self.get_values, micro_batch_size, VALUES, VALUES, VALUE_SEED_FIELDS)

    # ------------------------------------------------------------------ advantages
    def advantages_presharded(
        self,
        meta: KVBatchMeta,
        estimator: AdvantageEstimator,
        *,
        mode: str = ADV_FULL,
        logprob_fields: tuple[str, ...] = (),
        moments: list[float] | None = None,
    ) -> dict[str, Any] | None:
        """PPO advantages and critic targets of this rank's rows, written back as `advantages` / `returns`.

        `logprob_fields` names the logprob columns the estimator reads (the KL-in-reward term), none otherwise.
        `full`: the estimator as is (exact when this is the only shard); returns this shard's metric stats.
        `raw`: the estimator without whitening, writes both columns and returns the shard's float64 `moments`.
        `whiten`: rewrites `advantages` whitened with the batch `moments`; returns the metric stats.
        """
        if mode not in (ADV_FULL, ADV_RAW, ADV_WHITEN):
            raise ValueError(f"advantages_presharded: unknown mode {mode!r}")
        if meta.size == 0:
            return None
        if mode == ADV_WHITEN:
            if moments is None:
                raise ValueError("advantages_presharded: mode 'whiten' needs the batch moments")
            data = self.data_plane.fetch(meta, (TOKEN_MASK, SAMPLE_MASK, VALUES, RETURNS, ADVANTAGES))
            mask = data[TOKEN_MASK] * data[SAMPLE_MASK].unsqueeze(-1)  # [n, W]
            advantages = whiten_with_moments(data[ADVANTAGES], mask, moments, estimator)  # [n, W]
            self.data_plane.write_back(meta, ADVANTAGES, advantages, per_token=True)
            return shard_advantage_stats(advantages, data[RETURNS], data[VALUES], mask)

        unknown = set(logprob_fields) - {PREV_LOGPROBS, REFERENCE_POLICY_LOGPROBS}
        if unknown:
            raise ValueError(f"advantages_presharded: logprob_fields may only name logprob columns, got {unknown}")
        data = self.data_plane.fetch(meta, ADVANTAGE_FIELDS + tuple(logprob_fields))
        mask = data[TOKEN_MASK] * data[SAMPLE_MASK].unsqueeze(-1)  # [n, W] as the legacy trainer builds it
        prev_lp = data.get(PREV_LOGPROBS)  # [n, W] | None
        ref_lp = data.get(REFERENCE_POLICY_LOGPROBS)  # [n, W] | None
        if prev_lp is not None and ref_lp is None:  # a skipped reference pass is zeros, as in the legacy trainer
            ref_lp = torch.zeros_like(prev_lp)
        est = estimator if mode == ADV_FULL else without_normalization(estimator)
        advantages, returns = est.compute_advantage(
            torch.zeros(meta.size, 1),
            data[REWARDS],
            mask,
            data[VALUES],
            logprobs_policy=prev_lp,
            logprobs_reference=ref_lp,
        )  # [n, W], [n, W]
        self.data_plane.write_back(meta, ADVANTAGES, advantages, per_token=True)
        self.data_plane.write_back(meta, RETURNS, returns, per_token=True)
        if mode == ADV_RAW:
            return {"moments": advantage_moments(advantages, mask).tolist()}
        return shard_advantage_stats(advantages, returns, data[VALUES], mask)

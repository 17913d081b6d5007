"""The trainers' side of the flight recorder (`logger.flight_recorder`): which steps are recorded, and what the
driver adds to a step's file.

The data-plane trainer asks the rollout actor, which holds the rows' text and reaches the store, to write the file
(`RecordRequest`); the driver contributes only per-row scalars it already has. The legacy trainer holds the whole
batch and writes the same columns itself. Recording reads and writes nothing a training metric depends on; its cost
is the `timing/train/flight_recorder` timer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from relayrl.config import MasterConfig
from relayrl.data_plane.codec import Column
from relayrl.data_plane.recorder import ROLLOUTS_DIR, RecordValue, warm_up, write_step
from relayrl.data_plane.schema import DP_TRAIN_FIELDS, INPUT_LENGTHS, TOKEN_ALIGNED_FIELDS, sample_key
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.flight_recorder import RecordRequest, rollout_rows
from relayrl.experience.sync_rollout_actor import prompt_group_ids

TIMER = "flight_recorder"


def recorded_fields(skip_prev: bool, skip_ref: bool) -> list[str]:
    """The training columns a step recorded: what training reads, minus the log-prob passes the step skipped."""
    skipped = ({"prev_logprobs"} if skip_prev else set()) | ({"reference_policy_logprobs"} if skip_ref else set())
    return [f for f in DP_TRAIN_FIELDS if f not in skipped]


class StepRecorder:
    """When to record and where: `RUN_DIR/rollouts/`, every `every_n_steps`-th step, newest `keep_last` files."""

    def __init__(self, cfg: MasterConfig, run_dir: str | Path, trainer: str) -> None:
        fr = cfg.logger.flight_recorder
        self.enabled, self.every_n_steps, self.keep_last = fr.enabled, fr.every_n_steps, fr.keep_last
        self.dir = str(Path(run_dir) / ROLLOUTS_DIR)
        self.trainer, self.algorithm = trainer, cfg.algorithm
        if self.enabled:
            warm_up()

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every_n_steps == 0

    def driver_columns(
        self, step: int, rewards: torch.Tensor, baseline: torch.Tensor | None = None, std: torch.Tensor | None = None
    ) -> dict[str, RecordValue]:
        """Per-row values the driver holds: the version of the weights that generated the rows (updates done
        before this step), the post-processed reward the advantages used, and (GRPO) its group baseline and std."""
        n = rewards.shape[0]
        out: dict[str, RecordValue] = {"weight_version": [step - 1] * n, "reward": rewards.float()}  # [B]
        if baseline is not None and std is not None:
            out.update(baseline=baseline.float(), std=std.float())  # [B] each
        return out

    def info(self, step: int, rollout_metrics: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": step,
            "weight_version": step - 1,
            "trainer": self.trainer,
            "algorithm": self.algorithm,
            "rollout_metrics": dict(rollout_metrics),  # as returned (ints stay ints): a replay hands them back
        }

    def request(
        self, step: int, fields: list[str], driver_columns: dict[str, Any], info: dict[str, Any]
    ) -> RecordRequest:
        return RecordRequest(step, self.dir, self.keep_last, fields, driver_columns, info)


def record_legacy_step(
    recorder: StepRecorder,
    step: int,
    train_batch: BatchedDataDict,
    train_data: BatchedDataDict,
    fields: list[str],
    rewards: torch.Tensor,
    rollout_metrics: dict[str, Any],
    group_size: int,
) -> str:
    """The legacy trainer's file: the same columns the data-plane trainer records, from the driver's batch."""
    lengths = train_data[INPUT_LENGTHS].long()  # [B]
    prompt_lengths = train_batch["length"].long()  # [B]
    n = lengths.shape[0]
    keys = [sample_key(f"step{step}_p{i // group_size}", i % group_size) for i in range(n)]
    columns: dict[str, RecordValue] = {"sample_key": keys}
    columns.update(
        rollout_rows(
            train_batch["message_log"],
            train_batch["env_reward"],
            train_batch["loss_multiplier"],
            train_batch["truncated"],
            prompt_lengths,
            prompt_group_ids(train_batch["prompt_ids"], prompt_lengths),
            train_batch.get("task_name"),
            train_batch.get("extra_env_info"),
        )
    )
    for name in fields:
        value = train_data[name]
        aligned = name in TOKEN_ALIGNED_FIELDS and value.dim() >= 2
        columns[name] = Column.from_padded(value, lengths) if aligned else value  # [B, S] -> jagged; [B] as is
    columns.update(recorder.driver_columns(step, rewards, train_batch["baseline"], train_batch["std"]))
    return str(write_step(recorder.dir, step, columns, recorder.info(step, rollout_metrics), recorder.keep_last))

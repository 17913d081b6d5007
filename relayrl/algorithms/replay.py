"""`relayrl replay`: train again on recorded rollouts, without generating.

The policy is rebuilt at step N − 1 (the run's `step_{N-1}` checkpoint; for N = 1 the run's initial weights, which
its seed makes exact), then each recorded step goes through the data-plane GRPO trainer's own phases
(`GRPOSyncSteps.step`: rewards, log-probs, advantages, loss, update) with a `RecordedSource` as its rollout source:
it writes the recorded rows into the store under their recorded keys and hands over the carry the actor returned. Nothing about the step is re-implemented, so on CPU the replayed `train/*` metrics equal the
recorded ones, and an override (a loss setting, say) shows its effect on exactly the same data.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.algorithms.advantages import message_level_advantages
from relayrl.algorithms.grpo_sync import GRPOSyncSteps, grpo_rollout_spec, grpo_step_start
from relayrl.algorithms.logprob_error import act_on_logprob_error
from relayrl.algorithms.protocols import Generation, Rollout
from relayrl.algorithms.rollout_sources import RolloutSpec, StepStart, prepare_rollout, received
from relayrl.algorithms.setup import DataPlaneComponents, setup
from relayrl.algorithms.trainer_common import KvScaleSync
from relayrl.config import MasterConfig
from relayrl.data_plane.column_io import first_write
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.data_plane.recorder import ROLLOUTS_DIR, read_step, recorded_steps, table_column, table_info
from relayrl.data_plane.schema import (
    GENERATION_LOGPROBS,
    INPUT_IDS,
    INPUT_LENGTHS,
    ROLLOUT_METRICS,
    SAMPLE_MASK,
    TOKEN_MASK,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.carry_wire import encode_carry
from relayrl.experience.flight_recorder import RecordRequest
from relayrl.utils.checkpoint_read import read_checkpoint
from relayrl.utils.config_io import load_config
from relayrl.utils.jsonl import read_jsonl
from relayrl.utils.timer import TOTAL, UNACCOUNTED, Timer, phase_remainder

#: Metrics that measure time, not training: never compared.
_TIMED = ("valid_tokens_per_sec",)
#: Byte accounting of where data moved: a legacy-trainer run (replayed on the data-plane trainer) moved it elsewhere.
_BYTES = ("driver_bytes", "store_bytes_written", "driver_fraction_of_store_bytes", "driver_meta_bytes")


@dataclass
class ReplayReport:
    steps: list[int]
    metrics_path: Path
    compared: int  # metric values compared against the run's
    mismatches: list[tuple[int, str, float, float]]  # (step, metric, recorded, replayed)
    legacy: bool = False  # the run used the legacy trainer: its byte counters were not compared


def replay_config(run_dir: Path, overrides: Sequence[str], out: Path) -> MasterConfig:
    """The run's own config plus `overrides`, on the data-plane trainer, without recording or TensorBoard."""
    cfg = load_config(run_dir / "config.yaml", list(overrides))
    if cfg.algorithm != "grpo":
        raise ValueError(f"relayrl replay supports GRPO runs; {run_dir} is a {cfg.algorithm} run")
    if cfg.grpo.use_dynamic_sampling:
        raise ValueError("relayrl replay cannot replay dynamic sampling (grpo.use_dynamic_sampling=true)")
    if message_level_advantages(cfg):  # their per-token overrides are not in the flight recording
        raise ValueError("relayrl replay cannot replay message-level advantage penalties (invalid_tool_call_advantage)")
    update = {
        "data_plane": cfg.data_plane.model_copy(update={"enabled": True}),  # the legacy trainer's numbers are equal
        "checkpointing": cfg.checkpointing.model_copy(update={"checkpoint_dir": str(out / "checkpoints")}),
        "logger": cfg.logger.model_copy(
            update={
                "tensorboard_enabled": False,
                "wandb_enabled": False,
                "mlflow_enabled": False,
                "flight_recorder": cfg.logger.flight_recorder.model_copy(update={"enabled": False}),
            }
        ),
    }
    return cfg.model_copy(update=update)


def source_checkpoint(run_dir: Path, cfg: MasterConfig, step: int) -> Path | None:
    """`step_{step}` of the run (None for step 0: the initial weights); ValueError naming the fix when missing."""
    if step == 0:
        return None
    root = Path(cfg.checkpointing.checkpoint_dir) if cfg.checkpointing.checkpoint_dir else run_dir / "checkpoints"
    path = root / f"step_{step}"
    if not path.is_dir():
        have = sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit())
        raise ValueError(
            f"replay from step {step + 1} needs the checkpoint step_{step} in {root} (it has "
            f"{', '.join(f'step_{s}' for s in have) or 'none'}); replay from a step right after a saved one, or train "
            "with checkpointing.save_period=1 checkpointing.keep_top_k=null to be able to replay any step"
        )
    return path


class RecordedSource:
    """The rollouts of a replay: each `next` writes the next recorded step's rows into the store (the columns the
    actor wrote, under the same keys) and hands over the carry the actor returned, through the same phases and
    timers as a generated step (the engine is woken and released as it was, though nothing is generated)."""

    def __init__(
        self,
        tables: list[Any],
        generation: Generation,
        kv_sync: KvScaleSync,
        timer: Timer,
        spec: RolloutSpec,
        start_step: StepStart,
        cfg: MasterConfig,
    ) -> None:
        self.tables, self.generation, self.kv_sync, self.timer = list(tables), generation, kv_sync, timer
        self.spec, self.start_step, self.cfg = spec, start_step, cfg
        self.client: DataPlaneClient = build_data_plane_client(cfg.data_plane, bootstrap=False)

    def next(self, batch: BatchedDataDict, step: int, *, first_batch: bool, step_starts: bool) -> Rollout:
        spec = self.spec
        prepare_rollout(batch, spec.group_size, self.timer, self.kv_sync, self.generation)  # an empty batch
        timer = self.timer
        if step_starts:
            with timer.time("data_plane"):
                self.start_step(self.client.metrics(reset=True))
        table = self.tables.pop(0)
        with timer.time("data_plane"):  # the recorded rows into the store: what the actor's rollout wrote
            meta, loss_multiplier, metrics = self._write(table)
        with timer.time("generation"):  # nothing is generated; the engine is released as after a rollout
            self.generation.finish_generation()
        with timer.time("data_processing"):
            carry = self._carry(table, loss_multiplier)
            return received(meta, encode_carry(carry, spec.group_size), metrics)  # the bytes the actor's carry had

    def _write(self, table: Any) -> tuple[KVBatchMeta, torch.Tensor, dict[str, Any]]:
        """The recorded step's bulk into the store under its recorded keys. Returns (meta, loss multiplier [B],
        rollout metrics)."""
        keys = table.column("sample_key").to_pylist()
        rollout_metrics = dict(table_info(table).get("rollout_metrics", {}))
        lengths = table_column(table, INPUT_LENGTHS).values  # [B]
        token_mask = table_column(table, TOKEN_MASK)
        loss_multiplier = torch.tensor(table.column("loss_multiplier").to_pylist(), dtype=torch.float32)  # [B]
        bulk = {
            INPUT_IDS: table_column(table, INPUT_IDS),
            INPUT_LENGTHS: lengths,
            GENERATION_LOGPROBS: table_column(table, GENERATION_LOGPROBS),
            TOKEN_MASK: token_mask,
            SAMPLE_MASK: loss_multiplier,
        }
        meta = first_write(
            bulk,
            keys=keys,
            client=self.client,
            partition_id=self.spec.partition_id,
            extra_info={ROLLOUT_METRICS: rollout_metrics},
            task_name=self.spec.partition_id,
            pad_to_multiple=self.cfg.policy.make_sequence_length_divisible_by,
        )
        return meta, loss_multiplier, rollout_metrics

    def _carry(self, table: Any, loss_multiplier: torch.Tensor) -> BatchedDataDict:
        """The carry the actor returned, rebuilt from the recorded columns (the keys this trainer asks for)."""
        token_mask = table_column(table, TOKEN_MASK)
        assert token_mask.lengths is not None  # per-token: recorded jagged
        loss_token_counts = torch.stack(
            [row.sum() for row in token_mask.values.split(token_mask.lengths.tolist())]
        )  # [B]
        carry_keys, text_rows = self.spec.carry_keys, self.spec.text_rows

        def col(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(table.column(name).to_pylist(), dtype=dtype)  # [B]

        prompts, completions = table.column("prompt").to_pylist(), table.column("completion").to_pylist()
        n = len(prompts)
        shown = n if text_rows is None else min(text_rows, n)
        builders = {
            "total_reward": lambda: col("reward_env", torch.float32),
            "loss_multiplier": lambda: loss_multiplier,
            "truncated": lambda: col("truncated", torch.bool),
            "length": lambda: col("prompt_length", torch.long),
            "prompt_group": lambda: col("prompt_group", torch.long),
            "loss_token_counts": lambda: loss_token_counts.long(),
            "response_token_lengths": lambda: col("response_token_length", torch.long),
            "sample_text": lambda: [(prompts[i], completions[i]) if i < shown else None for i in range(n)],
        }
        wanted = list(carry_keys or ["total_reward", "loss_multiplier", "truncated", "length", "prompt_group"])
        unknown = [k for k in wanted if k not in builders]
        if unknown:
            raise KeyError(f"replay cannot rebuild carry values {unknown} from a flight recording")
        return BatchedDataDict({k: builders[k]() for k in wanted})

    def record(self, meta: KVBatchMeta, request: RecordRequest) -> None:
        raise RuntimeError("a replay does not record (its config turns the flight recorder off)")

    def store_metrics(self) -> dict[str, float]:
        return self.client.metrics(True)

    def after_step(self, step: int) -> dict[str, float]:
        return {}

    def validating(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        self.client.close()


def _recorded_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for row in read_jsonl(path):
            out.setdefault(int(row.pop("step")), {}).update(row)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def replay_run(
    run_dir: Path, from_step: int, to_step: int | None, out: Path, overrides: Sequence[str] = ()
) -> ReplayReport:
    """Replay steps `from_step..to_step` of `run_dir` into `out`; returns what was compared with the run."""
    last = from_step if to_step is None else to_step
    if from_step < 1 or last < from_step:
        raise ValueError(f"--from-step must be >= 1 and --to-step >= --from-step (got {from_step}..{last})")
    cfg = replay_config(run_dir, overrides, out)
    run_cfg = load_config(run_dir / "config.yaml")
    gen = cfg.policy.generation
    if gen.top_k is not None or gen.top_p < 1.0:  # the recording has no `generation_support` column
        warnings.warn(
            "[WARN] replay: the flight recorder does not keep the sampler's top-k/top-p kept sets, so the replayed "
            "log-prob passes recompute the filter from their own logits (train/sampling/* is not logged)",
            stacklevel=2,
        )
    rollouts = run_dir / ROLLOUTS_DIR
    have = set(recorded_steps(rollouts))
    steps = list(range(from_step, last + 1))
    missing = [s for s in steps if s not in have]
    if missing:
        read_step(rollouts, missing[0])  # raises naming what is recorded
    source = source_checkpoint(run_dir, run_cfg, from_step - 1)
    tables = [read_step(rollouts, s) for s in steps]
    rows = cfg.grpo.rows_per_step
    if any(t.num_rows != rows for t in tables):
        raise ValueError(f"the recorded steps hold {tables[0].num_rows} rows but this config trains on {rows} per step")
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    if source is not None:
        _take_checkpoint(source, out / "checkpoints" / source.name)
    c = setup(cfg, out)
    try:
        assert isinstance(c, DataPlaneComponents)  # replay_config turned the data plane on
        timer = Timer()

        def no_validation(step: int) -> tuple[dict[str, float], dict[str, float]]:
            return {}, {}

        kv_sync = KvScaleSync(c.policy, c.policy_generation, timer, c.tokenizer.pad_token_id, None)  # no generation
        spec, start = grpo_rollout_spec(cfg, c.policy), grpo_step_start(c.policy, cfg)
        recorded = RecordedSource(tables, c.policy_generation, kv_sync, timer, spec, start, cfg)
        trainer = GRPOSyncSteps(
            c.policy, c.policy_generation, recorded, c.loss_fn, c.logger, cfg, timer, no_validation, kv_sync
        )
        try:
            for step in steps:
                timer.start(TOTAL)
                result = trainer.step(BatchedDataDict(), step)
                assert result is not None  # no dynamic sampling: every batch completes a step
                with timer.time("logging"):
                    c.logger.log_metrics(result.metrics, step, prefix="train")
                act_on_logprob_error(result.metrics, cfg.policy.generation, step, c.logger.print_message)
                timer.stop(TOTAL)
                timing = timer.get_timing_metrics("sum")
                timing[UNACCOUNTED] = phase_remainder(timing)
                c.logger.log_metrics(timing, step, prefix="timing/train")
                timer.reset()
        finally:
            trainer.close()
    finally:
        c.close()
    legacy = any(table_info(t).get("trainer") == "legacy" for t in tables)
    return _compare(run_dir, out, steps, skip=_TIMED + (_BYTES if legacy else ()), legacy=legacy)


def _take_checkpoint(source: Path, link: Path) -> None:
    """The replay's own copy of the run's checkpoint `source`, verified against its manifest: hard links (so the
    live run may prune it meanwhile), else a symbolic link. CheckpointError naming the damaged file."""
    if link.exists():
        return
    with read_checkpoint(source) as view:
        if view != source:
            try:
                shutil.copytree(view, link, copy_function=os.link)
                return
            except OSError:
                shutil.rmtree(link, ignore_errors=True)
        link.symlink_to(source.resolve(), target_is_directory=True)


def _compare(run_dir: Path, out: Path, steps: list[int], skip: tuple[str, ...], legacy: bool) -> ReplayReport:
    recorded, replayed = _recorded_metrics(run_dir), _recorded_metrics(out)
    compared, mismatches = 0, []
    for step in steps:
        for name, value in replayed.get(step, {}).items():
            if not name.startswith("train/") or name.endswith(skip) or name not in recorded.get(step, {}):
                continue
            compared += 1
            if not _same(recorded[step][name], value):
                mismatches.append((step, name, recorded[step][name], value))
    return ReplayReport(steps, out / "metrics.jsonl", compared, mismatches, legacy)

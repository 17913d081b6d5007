"""The outer loop every trainer shares: validation at start, epochs over the train loader, the step tail, shutdown.

A trainer supplies only what is its own: `step(batch, step)` (its named, timed phases) and `validate(step)`.
Everything around a step (counting, stopping rules, wall-clock budget, checkpoint cadence, what is logged where and
in which order) lives here once, which is what makes the legacy, data-plane and coming asynchronous trainers log
the same metrics the same way and stop at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from relayrl.algorithms.logprob_error import act_on_logprob_error
from relayrl.algorithms.protocols import BatchLoader, Checkpointable, Checkpointer, Generation, TrainLogger
from relayrl.config import MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.utils.checkpoint import DATALOADER_STATE, RNG_STATE, GRPOSaveState, data_plane_client_of, save_data_plane
from relayrl.utils.seeding import capture_rng_state
from relayrl.utils.signals import GracefulStop, TrainingInterrupted
from relayrl.utils.state_file import save_state_file
from relayrl.utils.timer import TOTAL, UNACCOUNTED, TimeoutChecker, Timer, phase_remainder
from relayrl.utils.write_failure import describe_write_failure

__all__ = [
    "CheckpointIncompleteError",
    "LoopParts",
    "StepOutput",
    "TrainerSteps",
    "check_weights_written",
    "early_stop_reached",
    "run_loop",
    "save_checkpoint",
]

Metrics = dict[str, float]


@dataclasses.dataclass
class StepOutput:
    """What a completed step hands the tail: its `train/*` metrics, rows for samples.jsonl, and extra entries for
    the returned summary (PPO's `critic` metrics)."""

    metrics: Metrics
    samples: list[dict[str, object]]
    extra: dict[str, Metrics] = dataclasses.field(default_factory=dict)
    data_plane_seconds: float | None = None
    """Data-plane trainers: the step's seconds in data-plane calls over every client (`data_plane/share_of_step`)."""


class TrainerSteps(Protocol):
    """A trainer as the loop sees it."""

    def step(self, batch: BatchedDataDict, step: int) -> StepOutput | None:
        """Run one step's phases on `batch`; None when the batch was consumed without completing a step (dynamic
        sampling still collecting groups)."""
        ...

    def validate(self, step: int) -> Metrics: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class LoopParts:
    """What the loop needs besides the trainer: the run's config, counters, loader, and the tail's collaborators."""

    cfg: MasterConfig
    state: GRPOSaveState
    timer: Timer
    dataloader: BatchLoader
    checkpointed: Checkpointable  # the policy, or policy and critic
    policy_generation: Generation
    checkpointer: Checkpointer
    logger: TrainLogger
    save_extra: Callable[[Path], None] | None = None  # trainer state beyond weights/loader/RNG (async: rollouts)


def run_loop(trainer: TrainerSteps, parts: LoopParts) -> dict[str, object]:
    """Run until max_num_steps / max_num_epochs / early stop / wall-clock budget. Returns the last metrics.

    SIGINT / SIGTERM end the current step, which is then checkpointed, and raise `TrainingInterrupted`.
    """
    cfg, state, timer, r = parts.cfg, parts.state, parts.timer, parts.cfg.rollout
    timeout = TimeoutChecker(cfg.checkpointing.checkpoint_must_save_by, fit_last_save_time=True)
    timeout.start_iterations()
    tail = StepTail(parts, timeout, trainer.validate)
    notice = "relayrl: stopping after this step and saving a checkpoint (Ctrl-C again exits at once)"
    with GracefulStop(notice) as stop:
        try:
            if r.val_at_start and state.total_steps == 0:
                val_metrics = trainer.validate(0)
                if early_stop_reached(val_metrics, cfg):
                    return {"validation": val_metrics}
            timer.reset()  # what validation at start timed (FP8 calibration) is no step's phase
            last: dict[str, object] = {}
            while state.current_epoch < r.max_num_epochs and state.total_steps < r.max_num_steps:
                for batch in parts.dataloader:
                    if stop.requested is not None:  # asked to stop between steps (or mid dynamic sampling)
                        raise TrainingInterrupted(stop.requested, state.total_steps, saved=False)
                    step = state.total_steps + 1
                    timer.start(TOTAL)
                    out = trainer.step(batch, step)
                    if out is None:
                        timer.stop(TOTAL)
                        continue
                    done, last = tail.finish(
                        step,
                        out.metrics,
                        out.samples,
                        stop_requested=lambda: bool(stop.requested),
                        data_plane_seconds=out.data_plane_seconds,
                    )
                    last.update(out.extra)
                    if stop.requested is not None:  # also a signal that came after the tail's checkpoint decision
                        saved = tail.saved_step == step or tail.save(step, {}, out.metrics)
                        raise TrainingInterrupted(stop.requested, step, saved=saved)
                    if done:
                        return last
                state.current_epoch += 1
                state.current_step = 0
            return last
        finally:
            if sys.exc_info()[0] is None:
                trainer.close()
            else:  # after a failure clean-up is best effort (a lost actor fails it too): the first error is reported
                with contextlib.suppress(Exception):
                    trainer.close()


def should_validate(total_steps_done: int, cfg: MasterConfig, is_last_step: bool) -> bool:
    r = cfg.rollout
    periodic = r.val_period > 0 and total_steps_done >= r.val_start_at and total_steps_done % r.val_period == 0
    return periodic or (r.val_at_end and is_last_step)


def early_stop_reached(val_metrics: Metrics, cfg: MasterConfig) -> bool:
    """True when the configured validation metric reached its threshold."""
    name = cfg.rollout.stop_at_validation_metric
    if name is None:
        return False
    if name not in val_metrics:
        raise KeyError(
            f"{cfg.algorithm}.stop_at_validation_metric {name!r} is not a validation metric ({sorted(val_metrics)})"
        )
    threshold = cfg.rollout.stop_at_validation_threshold
    assert threshold is not None  # enforced by MasterConfig
    return float(val_metrics[name]) >= threshold


def save_checkpoint(
    *,
    checkpointer: Checkpointer,
    policy: Checkpointable,
    policy_generation: Generation,
    dataloader: BatchLoader,
    state: GRPOSaveState,
    cfg: MasterConfig,
    metrics_for_ranking: dict[str, Metrics],
    save_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write step_N atomically: tmp dir, weights/optimizer/tokenizer, dataloader and RNG state, then rename."""
    info: dict[str, object] = dataclasses.asdict(state)
    metric = cfg.checkpointing.metric_name
    if metric is not None:
        source, name = metric.split(":", 1)
        src = metrics_for_ranking.get(source, {})
        if name in src:
            info[metric] = float(src[name])
    tmp = checkpointer.init_tmp_checkpoint(state.total_steps, info, cfg.model_dump(mode="json"))
    policy.save_checkpoint(
        weights_path=str(tmp / "policy" / "weights"),
        optimizer_path=str(tmp / "policy" / "optimizer") if cfg.checkpointing.save_optimizer else None,
        tokenizer_path=str(tmp / "policy" / "tokenizer"),
    )
    save_state_file(tmp / DATALOADER_STATE, dataloader.state_dict())  # safetensors + JSON: nothing to unpickle
    rng: dict[str, object] = {"global": capture_rng_state(), "generation": policy_generation.get_rng_state()}
    if policy_generation.kv_scales is not None:  # FP8 KV cache: the next step generates with these (exact resume)
        rng["kv_scales"] = policy_generation.kv_scales
    save_state_file(tmp / RNG_STATE, rng)
    if save_extra is not None:
        save_extra(tmp)
    if cfg.checkpointing.save_data_plane:
        save_data_plane(data_plane_client_of(policy), tmp, state.total_steps)
    check_weights_written(tmp, cfg)
    return checkpointer.finalize_checkpoint(tmp)


class CheckpointIncompleteError(RuntimeError):
    """A checkpoint about to be published lacks what a resume needs; the previous one stays the resume point."""


def check_weights_written(tmp: Path, cfg: MasterConfig) -> None:
    """Refuse to publish a checkpoint whose model weights (or optimizer state) the driver cannot see.

    Rank 0 writes them on its own node; on Ray, a run directory that node does not share with the driver would
    otherwise be published without them and fail only at the next resume or export.
    """
    models = ["policy", "value"] if cfg.algorithm == "ppo" else ["policy"]
    parts = [("weights", "*.safetensors")] + ([("optimizer", "*")] if cfg.checkpointing.save_optimizer else [])
    for model in models:
        for part, pattern in parts:
            where = tmp / model / part
            if not (where.is_dir() and any(where.glob(pattern))):
                raise CheckpointIncompleteError(
                    f"checkpoint step {tmp.name.removeprefix('tmp_step_')} was not published: {where} holds no "
                    f"{model} {part} as the driver sees it (rank 0 wrote them elsewhere): the run directory must be on storage that every "
                    "node of the cluster shares"
                )


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, read-only or vanished directory); the previous complete one
    stays the resume point. One line naming the path."""


@contextlib.contextmanager
def _write_failure(checkpointer: Checkpointer, step: int) -> Iterator[None]:
    """A failed checkpoint write: its temporary directory removed (space back), one `CheckpointWriteError` line.
    A dead or stuck rank, or the async producer's failure, keep their own errors."""
    from relayrl.algorithms.async_rollouts import ProducerDiedError
    from relayrl.distributed.errors import WorkerDiedError
    from relayrl.utils.deadlines import DeadlineError

    try:
        yield
    except (WorkerDiedError, DeadlineError, ProducerDiedError, CheckpointIncompleteError):
        raise
    except Exception as exc:  # OSError, torch's RuntimeError, safetensors' SafetensorError: a write that failed
        tmp = Path(getattr(checkpointer, "checkpoint_dir", ".")) / f"tmp_step_{step}"
        failed = describe_write_failure(exc, tmp)  # read from what the write left: before it is removed
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"the checkpoint of step {step} could not be written to {failed.where} ({failed.reason}"
            f"{failed.free_text()}); the newest complete checkpoint stays the resume point"
        ) from exc


class StepTail:
    """The end of every training step: validate, count, checkpoint, log. One copy for every trainer, so they log the
    same metrics in the same order."""

    def __init__(self, parts: LoopParts, timeout: TimeoutChecker, run_validation: Callable[[int], Metrics]) -> None:
        self.parts, self.timeout, self.run_validation = parts, timeout, run_validation
        self.saved_step = -1  # the last step written to a checkpoint

    def save(self, step: int, val_metrics: Metrics, metrics: Metrics) -> bool:
        """Checkpoint the state after `step` (before the loader yields the next batch); False when disabled."""
        p = self.parts
        if not p.cfg.checkpointing.enabled:
            return False
        with p.timer.time("checkpointing"), _write_failure(p.checkpointer, step):
            p.state.val_reward = float(val_metrics["accuracy"]) if val_metrics else None
            save_checkpoint(
                checkpointer=p.checkpointer,
                policy=p.checkpointed,
                policy_generation=p.policy_generation,
                dataloader=p.dataloader,
                state=p.state,
                cfg=p.cfg,
                metrics_for_ranking={"val": val_metrics, "train": metrics},
                save_extra=p.save_extra,
            )
        self.saved_step = step
        return True

    def is_last_step(self, step: int) -> bool:
        r, state = self.parts.cfg.rollout, self.parts.state
        return step >= r.max_num_steps or (
            state.current_epoch + 1 == r.max_num_epochs and state.current_step + 1 == len(self.parts.dataloader)
        )

    def finish(
        self,
        step: int,
        metrics: Metrics,
        samples: list[dict[str, object]],
        stop_requested: Callable[[], bool] = lambda: False,
        data_plane_seconds: float | None = None,
    ) -> tuple[bool, dict[str, object]]:
        """Validate if due, update counters, log the step, checkpoint if due (or a stop was requested), log its timing. Returns (stop, last
        metrics)."""
        p = self.parts
        cfg, state, timer, r = p.cfg, p.state, p.timer, p.cfg.rollout
        is_last = self.is_last_step(step)
        val_metrics = None
        if should_validate(step, cfg, is_last):
            with timer.time("validation"):
                val_metrics = self.run_validation(step)
        stop_early = val_metrics is not None and early_stop_reached(val_metrics, cfg)

        state.total_valid_tokens += int(metrics.get("global_valid_toks", 0))
        state.consumed_samples += r.num_prompts_per_step
        state.current_step += 1
        state.total_steps = step
        self.timeout.mark_iteration()
        out_of_time = self.timeout.check_save()
        # throughput counts the step's work up to here (its checkpoint, if it saves one, is not work on samples)
        step_time = max(timer.elapsed_so_far(TOTAL), 1e-9)
        metrics["valid_tokens_per_sec"] = metrics.get("global_valid_toks", 0.0) / step_time
        # logged before the checkpoint: a run killed right after its checkpoint must not resume past an unlogged step
        with timer.time("logging"):
            p.logger.log_metrics(metrics, step, prefix="train")
        # before the checkpoint: a failed step is never a resume point
        act_on_logprob_error(metrics, cfg.policy.generation, step, p.logger.print_message)
        if is_last or stop_early or out_of_time or stop_requested() or step % cfg.checkpointing.save_period == 0:
            self.save(step, val_metrics or {}, metrics)
        timer.stop(TOTAL)  # the step ends with its checkpoint: `checkpointing` is one of its phases (STEP_PHASES)
        timing = timer.get_timing_metrics("sum")
        timing[UNACCOUNTED] = phase_remainder(timing)
        p.logger.log_metrics(timing, step, prefix="timing/train")
        if data_plane_seconds is not None:  # of the whole step, as the timing breakdown's phases
            share = data_plane_seconds / max(float(timing[TOTAL]), 1e-9)  # type: ignore[arg-type]
            p.logger.log_metrics({"share_of_step": share}, step, prefix="data_plane")
        perf = {
            "samples_per_sec": r.rows_per_step / step_time,
            "tokens_per_sec": metrics["total_num_tokens"] / step_time,
        }
        p.logger.log_metrics(perf, step, prefix="performance")
        refit_metrics = getattr(p.policy_generation, "refit_metrics", None)
        if callable(refit_metrics):  # separate generation workers (Ray): refit/* time, bytes, ms per MB
            p.logger.log_metrics(refit_metrics(), step)
        if samples:
            p.logger.log_jsonl(samples, "samples.jsonl")
        timer.reset()
        stop = stop_early or out_of_time or state.total_steps >= r.max_num_steps
        if out_of_time:
            p.logger.print_message("Wall-clock budget reached: checkpoint saved, stopping.")
        return stop, {"train": metrics, "validation": val_metrics, "timing": timing}

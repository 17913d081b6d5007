"""Step pieces shared by the legacy trainer (grpo.py) and the data-plane trainer (grpo_sync.py).

Everything here is independent of *where* rollout tensors live, so both loops call the same code and differ only in
data movement.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relayrl.algorithms.reward_functions import apply_reward_shaping, scale_rewards
from relayrl.config import ClippedPGLossConfig, MasterConfig
from relayrl.environments.interfaces import MessageLog
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState
from relayrl.utils.seeding import capture_rng_state


def on_policy_single_step(cfg: MasterConfig) -> bool:
    """True when `grpo.skip_prev_logprobs_when_on_policy` applies: every training step is exactly one optimizer
    step on rollouts of the current weights, so a separate old-policy logprob pass would recompute what the
    training forward already has."""
    g, loss = cfg.grpo, cfg.loss_fn
    return (
        cfg.algorithm == "grpo"
        and g.skip_prev_logprobs_when_on_policy
        and g.num_prompts_per_step * g.num_generations_per_prompt == cfg.policy.train_global_batch_size
        and g.seq_logprob_error_threshold is None
        and not loss.use_cispo
        and not loss.disable_ppo_ratio
    )


def effective_loss_config(cfg: MasterConfig) -> ClippedPGLossConfig:
    """The loss config the trainer actually uses: the ratio is forced on-policy when the prev pass is skipped."""
    if on_policy_single_step(cfg) and not cfg.loss_fn.force_on_policy_ratio:
        return cfg.loss_fn.model_copy(update={"force_on_policy_ratio": True})
    return cfg.loss_fn


def resolve_logprob_skip_flags(cfg: MasterConfig) -> tuple[bool, bool]:
    """(skip_prev_logprobs, skip_reference_logprobs) for this config.

    Prev logprobs are only skippable when the ratio is forced to 1 and no logprob-error threshold needs them.
    """
    loss = effective_loss_config(cfg)
    threshold = cfg.rollout.seq_logprob_error_threshold
    skip_prev = loss.force_on_policy_ratio and threshold is None
    if loss.force_on_policy_ratio and threshold is not None:
        warnings.warn(
            "force_on_policy_ratio with seq_logprob_error_threshold: prev logprobs are still computed",
            stacklevel=2,
        )
    return skip_prev, not cfg.reference_model_needed


def first_assistant_lengths(message_logs: list[MessageLog]) -> torch.Tensor:
    """Token count of each row's first assistant message (the response length DAPO shaping penalises)."""
    lengths = []
    for i, log in enumerate(message_logs):
        msg = next((m for m in log if m["role"] == "assistant"), None)
        if msg is None:
            raise ValueError(f"row {i} has no assistant message to measure for reward shaping")
        lengths.append(len(msg["token_ids"]))
    return torch.tensor(lengths, dtype=torch.long)  # [B]


def post_process_rewards(
    rewards: torch.Tensor,
    truncated: torch.Tensor,
    response_lengths: Callable[[], torch.Tensor],
    cfg: MasterConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reward scaling, then shaping (the reference's order). Returns (rewards, unshaped copy or None).

    `response_lengths` is called only when shaping needs the first assistant turn's length of every row.
    """
    r = cfg.rollout
    rewards = scale_rewards(rewards, r.reward_scaling)
    if not r.reward_shaping.enabled:
        return rewards, None
    return apply_reward_shaping(rewards, r.reward_shaping, response_lengths(), truncated)


def should_validate(total_steps_done: int, cfg: MasterConfig, is_last_step: bool) -> bool:
    g = cfg.rollout
    periodic = g.val_period > 0 and total_steps_done >= g.val_start_at and total_steps_done % g.val_period == 0
    return periodic or (g.val_at_end and is_last_step)


def early_stop_reached(val_metrics: dict[str, Any], cfg: MasterConfig) -> bool:
    """True when the configured validation metric reached its threshold."""
    name = cfg.rollout.stop_at_validation_metric
    if name is None:
        return False
    if name not in val_metrics:
        raise KeyError(f"grpo.stop_at_validation_metric {name!r} is not a validation metric ({sorted(val_metrics)})")
    threshold = cfg.rollout.stop_at_validation_threshold
    assert threshold is not None  # enforced by MasterConfig
    return float(val_metrics[name]) >= threshold


def advantage_metrics(
    advantages: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor, valid_values: torch.Tensor | None = None
) -> dict[str, float]:
    """Summary statistics the reference logs under train/advantages/* and train/baseline_reward/*.

    `valid_values` may replace `advantages[mask.bool()]` when the caller has the loss-token values already.
    """
    valid = advantages[mask.bool()] if valid_values is None else valid_values
    out = {
        "advantages/mean": valid.mean().item() if valid.numel() else 0.0,
        "advantages/max": valid.max().item() if valid.numel() else 0.0,
        "advantages/min": valid.min().item() if valid.numel() else 0.0,
        "advantages/sum": advantages.sum().item(),
    }
    n = max(baseline.numel(), 1)
    out["baseline_reward/pct_0"] = 100.0 * (baseline == 0).sum().item() / n
    out["baseline_reward/pct_1"] = 100.0 * (baseline == 1).sum().item() / n
    out["baseline_reward/pct_mixed"] = 100.0 - out["baseline_reward/pct_0"] - out["baseline_reward/pct_1"]
    return out


def save_state_dict(state: GRPOSaveState) -> dict[str, Any]:
    return dataclasses.asdict(state) if dataclasses.is_dataclass(state) else dict(state)  # type: ignore[arg-type]


def save_checkpoint(
    *,
    checkpointer: CheckpointManager,
    policy: Any,
    policy_generation: Any,
    dataloader: Any,
    state: GRPOSaveState,
    cfg: MasterConfig,
    metrics_for_ranking: dict[str, Any],
) -> Path:
    """Write step_N atomically: tmp dir, weights/optimizer/tokenizer, dataloader and RNG state, then rename."""
    info = save_state_dict(state)
    metric = cfg.checkpointing.metric_name
    if metric is not None:
        source, name = metric.split(":", 1)
        src = metrics_for_ranking.get(source, {})
        if name in src:
            info[metric] = float(src[name])
    tmp = checkpointer.init_tmp_checkpoint(info["total_steps"], info, cfg.model_dump(mode="json"))
    policy.save_checkpoint(
        weights_path=str(tmp / "policy" / "weights"),
        optimizer_path=str(tmp / "policy" / "optimizer") if cfg.checkpointing.save_optimizer else None,
        tokenizer_path=str(tmp / "policy" / "tokenizer"),
    )
    torch.save(dataloader.state_dict(), tmp / "train_dataloader.pt")
    rng = {"global": capture_rng_state(), "generation": policy_generation.get_rng_state()}
    torch.save(rng, tmp / "rng_state.pt")
    return checkpointer.finalize_checkpoint(tmp)


@dataclasses.dataclass
class StepTail:
    """The end of every training step, identical in both trainers: validate, count, checkpoint, log.

    Keeping it in one place is what makes the legacy and data-plane trainers log the same metrics in the same order.
    """

    cfg: MasterConfig
    state: GRPOSaveState
    timer: Any
    timeout: Any
    dataloader: Any
    policy: Any
    policy_generation: Any
    checkpointer: CheckpointManager
    logger: Any
    run_validation: Any  # Callable[[int], dict[str, Any]]

    def is_last_step(self, step: int) -> bool:
        g = self.cfg.rollout
        return step >= g.max_num_steps or (
            self.state.current_epoch + 1 == g.max_num_epochs and self.state.current_step + 1 == len(self.dataloader)
        )

    def finish(self, step: int, metrics: dict[str, Any], samples: list[dict[str, Any]]) -> tuple[bool, dict[str, Any]]:
        """Validate if due, update counters, checkpoint if due, log. Returns (stop training, last metrics)."""
        cfg, state, timer, g = self.cfg, self.state, self.timer, self.cfg.rollout
        is_last = self.is_last_step(step)
        val_metrics = self.run_validation(step) if should_validate(step, cfg, is_last) else None
        stop_early = val_metrics is not None and early_stop_reached(val_metrics, cfg)

        state.total_valid_tokens += int(metrics.get("global_valid_toks", 0))
        state.consumed_samples += g.num_prompts_per_step
        state.current_step += 1
        state.total_steps = step
        self.timeout.mark_iteration()
        out_of_time = self.timeout.check_save()
        if cfg.checkpointing.enabled and (
            is_last or stop_early or out_of_time or step % cfg.checkpointing.save_period == 0
        ):
            with timer.time("checkpointing"):
                state.val_reward = float(val_metrics["accuracy"]) if val_metrics else None
                save_checkpoint(
                    checkpointer=self.checkpointer,
                    policy=self.policy,
                    policy_generation=self.policy_generation,
                    dataloader=self.dataloader,
                    state=state,
                    cfg=cfg,
                    metrics_for_ranking={"val": val_metrics or {}, "train": metrics},
                )
        timer.stop("total_step_time")
        timing = timer.get_timing_metrics("sum")
        step_time = max(timing["total_step_time"], 1e-9)
        metrics["valid_tokens_per_sec"] = metrics.get("global_valid_toks", 0.0) / step_time
        self.logger.log_metrics(metrics, step, prefix="train")
        self.logger.log_metrics(timing, step, prefix="timing/train")
        rows = g.num_prompts_per_step * g.num_generations_per_prompt
        perf = {"samples_per_sec": rows / step_time, "tokens_per_sec": metrics["total_num_tokens"] / step_time}
        self.logger.log_metrics(perf, step, prefix="performance")
        refit_metrics = getattr(self.policy_generation, "refit_metrics", None)
        if callable(refit_metrics):  # separate generation workers (Ray): refit/* time, bytes, ms per MB
            self.logger.log_metrics(refit_metrics(), step)
        if samples:
            self.logger.log_jsonl(samples, "samples.jsonl")
        timer.reset()
        stop = stop_early or out_of_time or state.total_steps >= g.max_num_steps
        if out_of_time:
            self.logger.print_message("Wall-clock budget reached: checkpoint saved, stopping.")
        return stop, {"train": metrics, "validation": val_metrics, "timing": timing}


def step_metrics(
    *,
    train_results: dict[str, Any],
    reward_for_log: torch.Tensor,
    filtered_reward: torch.Tensor | None,
    prompt_lengths: torch.Tensor,
    input_lengths: torch.Tensor,
    adv_metrics: dict[str, float],
    rollout_metrics: dict[str, Any],
    seq_err_metrics: dict[str, float],
    ds_metrics: dict[str, Any],
) -> dict[str, Any]:
    """The `train/*` metrics of a step, assembled the same way by both trainers."""
    from relayrl.algorithms.utils import aggregate_train_metrics

    metrics = aggregate_train_metrics(train_results["all_mb_metrics"])
    metrics.update(
        loss=float(train_results["loss"].sum()),
        grad_norm=float(train_results["grad_norm"]),
        reward=float(reward_for_log.float().mean()),
        mean_prompt_length=float(prompt_lengths.float().mean()),
        total_num_tokens=float(input_lengths.sum()),
        **adv_metrics,
        **rollout_metrics,
        **seq_err_metrics,
        **ds_metrics,
    )
    if filtered_reward is not None:
        metrics["filtered_reward"] = float(filtered_reward.float().mean())
    return metrics


def carry_sample_rows(carry: Any, rewards: torch.Tensor, step: int, n: int) -> list[dict]:
    """`sample_rows` of a data-plane carry: its `sample_text` exists only for the rows the rollout sent text for."""
    if "sample_text" not in carry:
        return []
    rows = [i for i, text in enumerate(carry["sample_text"]) if text is not None]
    texts = [carry["sample_text"][i] for i in rows]
    return sample_rows([t[0] for t in texts], [t[1] for t in texts], rewards[rows], step, n)


def sample_rows(prompts: list[str], completions: list[str], rewards: torch.Tensor, step: int, n: int) -> list[dict]:
    """A few prompts/completions/rewards of the step for samples.jsonl."""
    return [
        {"step": step, "prompt": p, "completion": c, "reward": float(r)}
        for p, c, r in list(zip(prompts, completions, rewards.tolist()))[:n]
    ]

"""Step pieces the GRPO and PPO trainers share, legacy and data-plane alike.

Everything here is independent of *where* rollout tensors live, so the trainers call the same code and differ only
in data movement. Pure math (advantages, rewards, losses) lives in the math modules; the loop around a step in
`runner.py`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from relayrl.algorithms.logprob_error import seq_logprob_error_metrics_from_rows
from relayrl.algorithms.protocols import (
    BatchLoader,
    Checkpointable,
    DataPlanePolicy,
    Generation,
    KvCalibrator,
    Tokenizer,
)
from relayrl.algorithms.utils import aggregate_train_metrics, mean_over_epochs, policy_train_metrics
from relayrl.config import ClippedPGLossConfig, MasterConfig, PPOConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface, MessageLog
from relayrl.experience.rollouts import batched_message_log_to_flat_message, pop_rollout_timings, run_multi_turn_rollout
from relayrl.utils.timer import Timer


class NonFiniteError(RuntimeError):
    """A NaN or infinite reward, advantage, loss or gradient norm, caught before it changed any weight."""


def guard_rewards(
    rewards: torch.Tensor, group_size: int, cfg: MasterConfig, step: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Non-finite rewards [B]: stop the run, or (`non_finite: skip`) zero every row of an offending prompt's group.

    Returns (rewards, drop): `drop` [B] marks the rows to take out of the loss, None when every reward is finite
    (then `rewards` is returned untouched, so a healthy run computes exactly what it did without the guard).
    """
    bad = ~torch.isfinite(rewards.float())  # [B]
    if not bool(bad.any()):
        return rewards, None
    rows = bad.nonzero().flatten().tolist()
    block = cfg.algorithm
    if cfg.rollout.non_finite == "stop":
        shown = ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")
        raise NonFiniteError(
            f"non-finite reward at step {step} in {len(rows)} sample(s) (rows {shown}); stopped before any weight "
            f"changed: fix the reward function, or set {block}.non_finite=skip to drop such samples"
        )
    groups = bad.view(-1, group_size).any(dim=1)  # [B / G]
    drop = groups.repeat_interleave(group_size)  # [B]
    return rewards.masked_fill(drop, 0.0), drop


def guard_finite(name: str, values: torch.Tensor | list[float], step: int) -> None:
    """A quantity the step computed from finite rewards must be finite: stop, naming it and the step."""
    if not bool(torch.isfinite(torch.as_tensor(values)).all()):
        raise NonFiniteError(f"non-finite {name} at step {step}; stopped before any weight changed")


def worker_seq_logprob_error_metrics(
    policy: DataPlanePolicy,
    meta: KVBatchMeta,
    sample_mask: torch.Tensor,
    rewards: torch.Tensor,
    threshold: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The legacy trainers' logprob-error metrics and threshold masking, from per-row errors the data-plane workers
    reduced next to the rows (only [B] values reach the driver)."""
    per_row = policy.seq_logprob_error_from_meta(meta)  # {seq_logprob_error [B], num_loss_tokens [B]}
    return seq_logprob_error_metrics_from_rows(
        per_row["seq_logprob_error"], per_row["num_loss_tokens"], sample_mask, rewards, threshold
    )


def guard_update(result: dict[str, Any], step: int) -> None:
    """The loss and gradient norm of an update must be finite. A non-finite gradient norm made the workers skip the
    optimizer step, so the weights are those before the offending update; stop before anything is checkpointed."""
    for name in ("loss", "grad_norm"):
        value = result.get(name)
        if value is not None and not bool(torch.isfinite(torch.as_tensor(value)).all()):
            raise NonFiniteError(f"non-finite {name} at step {step}; stopped before the offending update")


def on_policy_single_step(cfg: MasterConfig) -> bool:
    """True when `grpo.skip_prev_logprobs_when_on_policy` applies: every training step is exactly one optimizer
    step, so the old policy (pi_old) is the very weights the training forward runs with and a separate old-policy
    logprob pass would recompute what that forward already has (its detached logprobs are pi_old).

    In asynchronous GRPO with stale samples the same holds: pi_old is the trainer's weights at the step's start, not
    the generator's; the importance-sampling weight pi_old / pi_generator is then taken from the training forward
    (`effective_loss_config` keeps the correction on), so stale samples are corrected exactly as with a separate pass.
    Not when something reads pi_old before training: the sequence-level logprob-error threshold, a KL-in-reward
    estimator, CISPO / REINFORCE losses."""
    g, loss = cfg.grpo, cfg.loss_fn
    return (
        cfg.algorithm == "grpo"
        and g.skip_prev_logprobs_when_on_policy
        and g.rows_per_step == cfg.policy.train_global_batch_size
        and g.seq_logprob_error_threshold is None
        and not loss.use_cispo
        and not loss.disable_ppo_ratio
        and not loss.use_kl_in_reward
    )


def off_policy_async(cfg: MasterConfig) -> bool:
    """True for asynchronous GRPO with a staleness bound above 0: samples may come from older weights, so the loss
    applies the importance-sampling correction pi_old / pi_generator (pi_old recomputed with the trainer's weights:
    by a separate pass, or by the training forward itself when `on_policy_single_step`)."""
    a = cfg.grpo.async_grpo
    return cfg.algorithm == "grpo" and a.enabled and a.max_trajectory_age_steps > 0


def effective_loss_config(cfg: MasterConfig) -> ClippedPGLossConfig:
    """The loss config the trainer actually uses: the ratio is forced on-policy when the prev pass is skipped;
    off-policy async GRPO always corrects by importance sampling (pi_old / pi_generator, truncated as configured)."""
    update: dict[str, bool] = {}
    if on_policy_single_step(cfg) and not cfg.loss_fn.force_on_policy_ratio:
        update["force_on_policy_ratio"] = True
    if off_policy_async(cfg) and not cfg.loss_fn.use_importance_sampling_correction:
        update["use_importance_sampling_correction"] = True
    return cfg.loss_fn.model_copy(update=update) if update else cfg.loss_fn


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


def step_metrics(
    *,
    train_results: dict[str, Any],
    reward_for_log: torch.Tensor,
    filtered_reward: torch.Tensor | None,
    prompt_lengths: torch.Tensor,
    input_lengths: torch.Tensor,
    adv_metrics: dict[str, float],
    rollout_metrics: dict[str, float],
    seq_err_metrics: dict[str, float],
    ds_metrics: dict[str, float],
) -> dict[str, float]:
    """The `train/*` metrics of a GRPO step, assembled the same way by both trainers."""
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


def rollout_carry_keys(base: list[str], reward_shaping: bool, num_samples_to_log: int) -> list[str]:
    """The per-row values a data-plane trainer takes back from the rollout actor (shaping and sample logging add
    their own)."""
    return (
        base + (["response_token_lengths"] if reward_shaping else []) + (["sample_text"] if num_samples_to_log else [])
    )


def carry_sample_rows(carry: BatchedDataDict, rewards: torch.Tensor, step: int, n: int) -> list[dict]:
    """`sample_rows` of a data-plane carry: its `sample_text` exists only for the rows the rollout sent text for."""
    if "sample_text" not in carry:
        return []
    rows = [i for i, text in enumerate(carry["sample_text"]) if text is not None]
    texts = [carry["sample_text"][i] for i in rows]
    return sample_rows([t[0] for t in texts], [t[1] for t in texts], rewards[rows], step, n)


def message_log_sample_rows(
    message_logs: list[MessageLog], rewards: torch.Tensor, step: int, cfg: MasterConfig
) -> list[dict[str, object]]:
    """`sample_rows` of driver-side message logs: prompt = system and user turns, completion = assistant turns."""
    return sample_rows(
        ["".join(m["content"] for m in log if m["role"] in ("system", "user")) for log in message_logs],
        ["".join(m["content"] for m in log if m["role"] == "assistant") for log in message_logs],
        rewards,
        step,
        cfg.logger.num_train_samples_to_log,
    )


def sample_rows(prompts: list[str], completions: list[str], rewards: torch.Tensor, step: int, n: int) -> list[dict]:
    """A few prompts/completions/rewards of the step for samples.jsonl."""
    return [
        {"step": step, "prompt": p, "completion": c, "reward": float(r)}
        for p, c, r in list(zip(prompts, completions, rewards.tolist()))[:n]
    ]


def rollout_in_driver(
    generation: Generation,
    timer: Timer,
    repeated: BatchedDataDict,
    tokenizer: Tokenizer,
    task_to_env: dict[str, EnvironmentInterface],
    cfg: MasterConfig,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """The legacy trainers' generation phase: wake the engine, roll every row out with the current weights (the
    engine refuses stale ones), put it to sleep. Returns the rolled-out batch and the rollout metrics."""
    with timer.time("refit"):  # the engine syncs to the policy's weights here
        generation.prepare_for_generation()
    with timer.time("generation"):
        out = run_multi_turn_rollout(
            generation,
            repeated,
            tokenizer,
            task_to_env,
            max_seq_len=cfg.policy.max_total_sequence_length,
            max_rollout_turns=cfg.rollout.max_rollout_turns,
            greedy=False,
        )
        generation.finish_generation()
    split_rollout_timings(timer, "generation", out[1])
    return out


def split_rollout_timings(timer: Timer, label: str, rollout_metrics: dict[str, Any]) -> None:
    """Move the rollout's own clock (its environment's and store writes' seconds, `pop_rollout_timings`) out of its
    metrics and out of `label`'s latest duration into phases of their own, so the step's phases stay disjoint."""
    for phase, seconds in pop_rollout_timings(rollout_metrics).items():
        timer.split_off(label, phase, seconds)


class KvScaleSync:
    """FP8 KV cache (`policy.generation.kv_cache_dtype=fp8`): the policy's calibrated scales follow its weights.

    As the reference (NeMo RL) does, the policy calibrates (`include_q=True`) before the first
    refit, on the prompts about to be rolled out (or the first validation batch when validation comes first), and
    after every training step, on the sequences it just trained on. `set_kv_scales` hands the `layers` dict to the
    engine, which sends it with its next refit: in the collective broadcast (`broadcast_weights_for_collective(
    kv_scales)`) to a separate generation group, by a call to colocated workers, in place to the driver's own
    engine. One copy for every trainer; with any other cache dtype every method returns at once, so runs are
    unchanged."""

    def __init__(
        self,
        policy: KvCalibrator,
        generation: Generation,
        timer: Timer,
        pad_id: int,
        val_dataloader: BatchLoader | None,
    ) -> None:
        self.policy, self.generation, self.timer, self.pad_id = policy, generation, timer, pad_id
        self.val_dataloader = val_dataloader
        self.enabled = bool(getattr(generation, "requires_kv_scale_sync", False))
        # the last ones handed to generation (a resumed run's engine holds its checkpoint's)
        self.scales = generation.kv_scales if self.enabled else None

    def before_first_refit(self, batch: BatchedDataDict) -> None:
        """Calibrate on the prompts of `batch` (its message logs) unless scales exist already."""
        if not self.enabled or self.scales is not None:
            return
        with self.timer.time("recompute_kv_scales"):  # a step's phase; before validation at step 0, no step's
            flat, lengths = batched_message_log_to_flat_message(
                batch["message_log"], pad_value_dict={"token_ids": self.pad_id}
            )
            self._calibrate(BatchedDataDict(input_ids=flat["token_ids"], input_lengths=lengths))  # [B, P], [B]

    def before_validation(self) -> None:
        """Validation before any step (`val_at_start`): calibrate on the first validation batch's prompts."""
        if self.enabled and self.scales is None and self.val_dataloader is not None:
            for batch in self.val_dataloader:  # in order, not shuffled: reading a batch changes no state
                self.before_first_refit(batch)
                break

    def after_training(self, read: Callable[[], BatchedDataDict]) -> None:
        """Recalibrate on the step's trained sequences (`read()` gives their input_ids and input_lengths), timed as
        `recompute_kv_scales`; the next refit carries the new scales."""
        if self.enabled:
            with self.timer.time("recompute_kv_scales"):
                self._calibrate(read())

    def _calibrate(self, data: BatchedDataDict) -> None:
        layers = self.policy.calibrate_qkv_fp8_scales(data, include_q=True)["layers"]
        self.scales = {str(k): float(v) for k, v in layers.items()}
        self.generation.set_kv_scales(self.scales)


def driver_nbytes(batch: BatchedDataDict) -> int:
    """Bytes of every tensor in `batch`: what the legacy path moves through the driver."""
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------------------------------- PPO
class PolicyAndCritic:
    """Lets the shared checkpoint writer save the critic beside the policy: step_N/value/{weights,optimizer,tokenizer}."""

    def __init__(self, policy: Checkpointable, value: Checkpointable) -> None:
        self.policy, self.value = policy, value

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        self.policy.save_checkpoint(weights_path, optimizer_path, tokenizer_path)
        root = Path(weights_path).parent.parent / "value"
        optimizer = str(root / "optimizer") if optimizer_path is not None else None
        self.value.save_checkpoint(str(root / "weights"), optimizer, str(root / "tokenizer"))


class Trainable(Protocol):
    def prepare_for_training(self) -> None: ...
    def finish_training(self) -> None: ...


def ppo_epochs(
    timer: Timer,
    p: PPOConfig,
    step: int,
    value: Trainable,
    train_value: Callable[[], dict[str, Any]],
    policy: Trainable,
    train_policy: Callable[[], dict[str, Any]],
) -> tuple[bool, dict[str, float], dict[str, float]]:
    """`ppo_epochs` × (critic update, then actor update unless still in the critic warm-up).

    Returns (policy trained, critic metrics, policy metrics), each metric one number over the epochs.
    """
    policy_trains = step - 1 >= p.policy_training_start_step  # steps already done, as the warm-up counts them
    critic_results, policy_results = [], []
    for _ in range(p.ppo_epochs):
        with timer.time("value_training"):
            value.prepare_for_training()
            critic_results.append(train_value())
            guard_update(critic_results[-1], step)
            value.finish_training()
        if policy_trains:
            with timer.time("policy_training"):
                policy.prepare_for_training()
                policy_results.append(train_policy())
                guard_update(policy_results[-1], step)
                policy.finish_training()
    critic_metrics = mean_over_epochs([r["metrics"] for r in critic_results])
    metrics = mean_over_epochs([policy_train_metrics(r) for r in policy_results])
    metrics.setdefault("global_valid_toks", critic_metrics.get("global_valid_toks", 0.0))
    return policy_trains, critic_metrics, metrics


def ppo_step_metrics(
    rewards: torch.Tensor,
    prompt_lengths: torch.Tensor,
    total_num_tokens: float,
    policy_trained: bool,
    adv_metrics: dict[str, float],
    rollout_metrics: dict[str, float],
    seq_err_metrics: dict[str, float],
    filter_metrics: dict[str, float],
    ds_metrics: dict[str, float] | None = None,
    filtered_reward: torch.Tensor | None = None,
) -> dict[str, float]:
    """The `train/*` metrics of a PPO step besides the update's and the byte counters, in both trainers' order.
    `rewards` is every reward generated for the step; under dynamic sampling `filtered_reward` those trained on."""
    metrics = dict(
        reward=float(rewards.float().mean()),
        mean_prompt_length=float(prompt_lengths.float().mean()),
        total_num_tokens=total_num_tokens,
        policy_trained=float(policy_trained),
        **adv_metrics,
        **rollout_metrics,
        **seq_err_metrics,
        **filter_metrics,
        **(ds_metrics or {}),
    )
    if filtered_reward is not None:
        metrics["filtered_reward"] = float(filtered_reward.float().mean())
    return metrics

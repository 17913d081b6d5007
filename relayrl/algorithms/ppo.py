"""PPO, legacy path: actor-critic training with GAE; every rollout tensor travels through the driver.

The step follows the reference order (§6.5): repeat → generate → rewards (scaling/shaping, overlong filtering) →
loss masks on every assistant message → values → prev/reference logprobs → logprob-error masking → advantages and
returns → `ppo_epochs` × (critic update, then actor update unless in critic warm-up) → validate → checkpoint (policy
and critic) → log `train/*` and `critic/*`. The rollout, reward, validation and step-tail helpers are GRPO's; the
ones that still read `cfg.grpo` (`validate`, the dataloaders) get `rollout_view`, whose `grpo` block carries the PPO
block's settings.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from relayrl.algorithms.gae import advantage_value_metrics, build_ppo_advantage_estimator, require_valid_tokens
from relayrl.algorithms.grpo import validate
from relayrl.algorithms.grpo_common import (
    StepTail,
    early_stop_reached,
    first_assistant_lengths,
    post_process_rewards,
    sample_rows,
)
from relayrl.algorithms.logprob_error import compute_seq_logprob_error_metrics
from relayrl.algorithms.utils import mean_over_epochs, policy_train_metrics
from relayrl.config import GRPOConfig, MasterConfig, PPOConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.rollouts import (
    add_token_loss_masks,
    batched_message_log_to_flat_message,
    run_multi_turn_rollout,
    trim_to_last_loss_token,
)
from relayrl.utils.checkpoint import GRPOSaveState
from relayrl.utils.timer import TimeoutChecker, Timer

__all__ = ["build_ppo_train_data", "ppo_train"]

_SHARED_ROLLOUT_KEYS = tuple(k for k in PPOConfig.model_fields if k in GRPOConfig.model_fields and k != "adv_estimator")


def rollout_view(cfg: MasterConfig) -> MasterConfig:
    """`cfg` with its `grpo` block replaced by the PPO block's rollout/validation/reward settings.

    Helpers written for GRPO that read `cfg.grpo` (`validate`, `build_dataloaders`) can then serve PPO unchanged.
    Never dumped: checkpoints store the real config.
    """
    if cfg.algorithm != "ppo":
        return cfg
    shared = {k: getattr(cfg.ppo, k) for k in _SHARED_ROLLOUT_KEYS}
    return cfg.model_copy(update={"grpo": GRPOConfig(**shared)})


def build_ppo_train_data(
    batch: BatchedDataDict, rewards: torch.Tensor, pad_id: int, cfg: MasterConfig
) -> tuple[BatchedDataDict, dict[str, float]]:
    """Overlong filtering, loss masks on every assistant message, flattening: the tensors both models train on.
    Rows are cut after their last loss token (trailing tokens change no loss, value target or advantage).

    Returns {input_ids, input_lengths, generation_logprobs, rewards, token_mask, sample_mask} and filter metrics.
    """
    sample_mask = batch["loss_multiplier"].clone().float()  # [B]
    truncated = torch.as_tensor(batch["truncated"], dtype=torch.bool)  # [B]
    num_filtered = 0
    if cfg.ppo.overlong_filtering:
        num_filtered = int((truncated & (sample_mask > 0)).sum())
        sample_mask[truncated] = 0.0
    add_token_loss_masks(batch["message_log"], only_generated=False)
    flat, input_lengths = trim_to_last_loss_token(  # as GRPO and the rollout actor: same tensors on both paths
        *batched_message_log_to_flat_message(batch["message_log"], pad_value_dict={"token_ids": pad_id}),
        pad_value_dict={"token_ids": pad_id},
        make_sequence_length_divisible_by=cfg.policy.make_sequence_length_divisible_by,
    )
    train_data: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=flat["token_ids"],  # [B, S]
        input_lengths=input_lengths,  # [B]
        generation_logprobs=flat["generation_logprobs"],  # [B, S]
        rewards=rewards.float(),  # [B]
        token_mask=flat["token_loss_mask"],  # [B, S]
        sample_mask=sample_mask,  # [B]
    )
    return train_data, {"num_overlong_filtered": float(num_filtered)}


class _PolicyAndCritic:
    """Lets the shared checkpoint writer save the critic beside the policy: step_N/value/{weights,optimizer,tokenizer}."""

    def __init__(self, policy: Any, value: Any) -> None:
        self.policy, self.value = policy, value

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        self.policy.save_checkpoint(weights_path, optimizer_path, tokenizer_path)
        root = Path(weights_path).parent.parent / "value"
        optimizer = str(root / "optimizer") if optimizer_path is not None else None
        self.value.save_checkpoint(str(root / "weights"), optimizer, str(root / "tokenizer"))


def ppo_train(
    policy: Any,
    policy_generation: Any,
    value: Any,
    dataloader: Any,
    val_dataloader: Any,
    tokenizer: Any,
    loss_fn: Any,
    value_loss_fn: Any,
    task_to_env: dict[str, Any],
    val_task_to_env: dict[str, Any] | None,
    logger: Any,
    checkpointer: Any,
    save_state: GRPOSaveState,
    master_config: MasterConfig,
) -> dict[str, Any]:
    """Run PPO until max_num_steps / max_num_epochs / early stop / wall-clock budget. Returns the last metrics."""
    cfg, p = master_config, master_config.ppo
    view = rollout_view(cfg)
    state = save_state
    timer = Timer()
    timeout = TimeoutChecker(cfg.checkpointing.checkpoint_must_save_by, fit_last_save_time=True)
    timeout.start_iterations()
    estimator = build_ppo_advantage_estimator(p.adv_estimator, cfg.loss_fn)
    skip_ref = not cfg.reference_model_needed
    pad_id = tokenizer.pad_token_id
    last_metrics: dict[str, Any] = {}

    def run_validation(at_step: int) -> dict[str, Any]:
        policy_generation.prepare_for_generation()
        out = validate(policy_generation, val_dataloader, tokenizer, val_task_to_env, at_step, view, logger)
        policy_generation.finish_generation()
        if out:
            logger.log_metrics(out, at_step, prefix="validation")
        return out

    both = _PolicyAndCritic(policy, value)
    tail = StepTail(
        cfg, state, timer, timeout, dataloader, both, policy_generation, checkpointer, logger, run_validation
    )
    if p.val_at_start and state.total_steps == 0:
        start_metrics = run_validation(0)
        if early_stop_reached(start_metrics, cfg):
            return {"validation": start_metrics}

    while state.current_epoch < p.max_num_epochs and state.total_steps < p.max_num_steps:
        for batch in dataloader:
            step = state.total_steps + 1
            timer.start("total_step_time")

            # ---- repeat prompts G times, generate, post-process rewards ----
            with timer.time("data_processing"):
                repeated = batch.repeat_interleave(p.num_generations_per_prompt)
                prompt_flat, _ = batched_message_log_to_flat_message(
                    repeated["message_log"], pad_value_dict={"token_ids": pad_id}
                )
                prompt_ids = prompt_flat["token_ids"]  # [B, P]
            with timer.time("prepare_for_generation/total"):
                policy_generation.prepare_for_generation()
            with timer.time("generation"):
                repeated, rollout_metrics = run_multi_turn_rollout(
                    policy_generation,
                    repeated,
                    tokenizer,
                    task_to_env,
                    max_seq_len=cfg.policy.max_total_sequence_length,
                    max_rollout_turns=p.max_rollout_turns,
                    greedy=False,
                )
                policy_generation.finish_generation()
            with timer.time("reward_calculation"):
                lengths = functools.partial(first_assistant_lengths, repeated["message_log"])
                rewards, _ = post_process_rewards(repeated["total_reward"], repeated["truncated"], lengths, cfg)  # [B]
            with timer.time("data_processing"):
                train_data, filter_metrics = build_ppo_train_data(repeated, rewards, pad_id, cfg)

            # ---- critic values, prev and reference logprobs ----
            with timer.time("value_inference"):
                value.prepare_for_inference()
                values = value.get_values(train_data.select_keys(["input_ids", "input_lengths"]))["values"]
                train_data["values"] = values  # [B, S]
                value.finish_inference()
            with timer.time("policy_and_reference_logprobs"):
                policy.prepare_for_lp_inference()
                lp_data = train_data.select_keys(["input_ids", "input_lengths", "token_mask", "sample_mask"])
                prev_lp = policy.get_logprobs(lp_data)["logprobs"]  # [B, S]
                ref_lp = torch.zeros_like(prev_lp)  # [B, S]
                if not skip_ref:
                    ref_lp = policy.get_reference_policy_logprobs(lp_data)["reference_logprobs"]
                train_data["prev_logprobs"] = prev_lp
                train_data["reference_policy_logprobs"] = ref_lp
            train_data["sample_mask"], seq_err_metrics = compute_seq_logprob_error_metrics(
                train_data["token_mask"],
                train_data["sample_mask"],
                prev_lp,
                train_data["generation_logprobs"],
                rewards,
                p.seq_logprob_error_threshold,
            )

            # ---- advantages and critic targets ----
            with timer.time("advantage_calculation"):
                mask = train_data["token_mask"] * train_data["sample_mask"].unsqueeze(-1)  # [B, S]
                require_valid_tokens(mask)
                advantages, returns = estimator.compute_advantage(
                    prompt_ids, rewards, mask, values, logprobs_policy=prev_lp, logprobs_reference=ref_lp
                )
                train_data["advantages"] = advantages  # [B, S]
                train_data["returns"] = returns  # [B, S]

            # ---- ppo_epochs × (critic, actor); the actor waits for the critic warm-up ----
            train_policy = state.total_steps >= p.policy_training_start_step
            critic_results, policy_results = [], []
            for _ in range(p.ppo_epochs):
                with timer.time("value_training"):
                    value.prepare_for_training()
                    critic_results.append(value.train(train_data, value_loss_fn))
                    value.finish_training()
                if train_policy:
                    with timer.time("policy_training"):
                        policy.prepare_for_training()
                        policy_results.append(policy.train(train_data, loss_fn))
                        policy.finish_training()

            # ---- metrics, then validate / checkpoint / log (GRPO's step tail; the critic saved beside the policy) ----
            critic_metrics = mean_over_epochs([r["metrics"] for r in critic_results])
            metrics = mean_over_epochs([policy_train_metrics(r) for r in policy_results])
            metrics.setdefault("global_valid_toks", critic_metrics.get("global_valid_toks", 0.0))
            metrics.update(
                driver_bytes=float(_nbytes(train_data)),  # the legacy path moves every byte through the driver
                reward=float(rewards.float().mean()),
                mean_prompt_length=float(repeated["length"].float().mean()),
                total_num_tokens=float(train_data["input_lengths"].sum()),
                policy_trained=float(train_policy),
                **advantage_value_metrics(advantages, returns, values, mask),
                **rollout_metrics,
                **seq_err_metrics,
                **filter_metrics,
            )
            logs = repeated["message_log"]
            samples = sample_rows(
                ["".join(m["content"] for m in log if m["role"] in ("system", "user")) for log in logs],
                ["".join(m["content"] for m in log if m["role"] == "assistant") for log in logs],
                rewards,
                step,
                cfg.logger.num_train_samples_to_log,
            )
            logger.log_metrics(critic_metrics, step, prefix="critic")
            stop, last_metrics = tail.finish(step, metrics, samples)
            last_metrics["critic"] = critic_metrics
            if stop:
                return last_metrics
        state.current_epoch += 1
        state.current_step = 0
    return last_metrics


def _nbytes(batch: BatchedDataDict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))

"""Seed page 003, `nemo_rl.algorithms.grpo_sync` -> `relayrl.algorithms.grpo_sync`: every function the page names,
with its exact signature, and what each returns: the logprob-error metrics from the step's tensors, validation's
(val_metrics, timing_metrics) pair, the message-level penalty refusal naming the `grpo.*` keys, dynamic sampling
discarding filtered rows by sample id."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from relayrl.algorithms import grpo, grpo_sync, validation
from relayrl.algorithms.grpo_sync import (
    _apply_dynamic_sampling,
    _compute_seq_logprob_error_metrics,
    _raise_if_message_level_advantage_penalties_enabled,
    validate_sync,
)
from relayrl.config import MasterConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.carry_wire import encode_carry
from tests.unit.seeds.seed_signature import assert_seed_signature


# The page's signatures, written out (annotations dropped; `*` markers and defaults kept).
class Seed:
    @staticmethod
    def _raise_if_message_level_advantage_penalties_enabled(master_config): ...

    @staticmethod
    def _apply_dynamic_sampling(
        *,
        meta,
        driver_carry,
        pending_meta,
        pending_carry,
        pending_unfiltered_rewards,
        train_prompts_size,
        num_gen_batches,
        max_gen_batches,
        policy,
    ): ...

    @staticmethod
    def validate_sync(
        *,
        rollout_actor,
        policy,
        val_dataloader,
        val_task_to_env,
        step,
        master_config,
        logger=None,
        partition_id="val",
    ): ...

    @staticmethod
    def _compute_seq_logprob_error_metrics(
        *,
        token_mask,
        sample_mask,
        prev_logprobs,
        generation_logprobs,
        rewards,
        seq_logprob_error_threshold,
    ): ...

    @staticmethod
    def grpo_train_sync(
        policy,
        policy_generation,
        wrapped_dataloader,
        val_dataloader,
        tokenizer,
        loss_fn,
        task_to_env,
        val_task_to_env,
        logger,
        checkpointer,
        grpo_save_state,
        master_config,
    ): ...


@pytest.mark.parametrize(
    "name",
    [
        "_raise_if_message_level_advantage_penalties_enabled",
        "_apply_dynamic_sampling",
        "validate_sync",
        "_compute_seq_logprob_error_metrics",
        "grpo_train_sync",
    ],
)
def test_grpo_sync_function(name: str) -> None:
    assert_seed_signature(getattr(grpo_sync, name), getattr(Seed, name), exact=True)


# ---------------------------------------------------------------------------------------------- logprob error
def _columns() -> dict[str, torch.Tensor]:
    """Three rows of four positions (position 0 never counts). Row 0: tokens 1-3 in the loss, token 3 off by 0.5;
    row 1: tokens 2-3, each off by 1; row 2: sample_mask 0, so it has no loss tokens and stays out of the stats."""
    return {
        "token_mask": torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]]),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]),
        "prev_logprobs": torch.tensor([[0.0, -1.0, -1.0, -1.5], [0.0, 0.0, -1.0, -1.0], [0.0, -9.0, -9.0, -9.0]]),
        "generation_logprobs": torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, 0.0, -2.0, -2.0], [0.0, 0.0, 0.0, 0.0]]),
        "rewards": torch.tensor([0.0, 1.0, 1.0]),
    }


ERR0 = (2 + math.exp(0.5)) / 3  # mean of exp(|gen - prev|) over row 0's loss tokens: e^0, e^0, e^0.5
ERR1 = math.e  # row 1: e^1, e^1


def test_seq_logprob_error_metrics_with_a_threshold() -> None:
    cols = _columns()
    mask, metrics = _compute_seq_logprob_error_metrics(**cols, seq_logprob_error_threshold=2.0)
    assert mask.tolist() == [1.0, 0.0, 0.0]  # row 1's error e > 2 masks it; row 2 was masked already
    assert metrics == pytest.approx(
        {
            "max_seq_mult_prob_error": ERR1,
            "mean_seq_mult_prob_error": (ERR0 + ERR1) / 2,
            "min_seq_mult_prob_error": ERR0,
            "num_masked_seqs_by_logprob_error": 1.0,
            "masked_correct_pct": 1.0,  # the masked row had reward 1
            "max_seq_mult_prob_error_after_mask": ERR0,
            "mean_seq_mult_prob_error_after_mask": ERR0,
            "min_seq_mult_prob_error_after_mask": ERR0,
        }
    )
    assert cols["sample_mask"].tolist() == [1.0, 1.0, 0.0]  # the input mask is not modified


def test_seq_logprob_error_metrics_without_a_threshold_keep_the_mask() -> None:
    cols = _columns()
    mask, metrics = _compute_seq_logprob_error_metrics(**cols, seq_logprob_error_threshold=None)
    assert mask is cols["sample_mask"]
    assert metrics == pytest.approx(
        {
            "max_seq_mult_prob_error": ERR1,
            "mean_seq_mult_prob_error": (ERR0 + ERR1) / 2,
            "min_seq_mult_prob_error": ERR0,
        }
    )


# ---------------------------------------------------------------------------------------------- validation
VAL_REWARDS = [[1.0, 0.0], [1.0, 1.0]]  # two validation batches of two prompts
VAL_LENGTHS = [3.0, 5.0]  # mean generated tokens per sample, per batch


def _val_config() -> MasterConfig:
    return MasterConfig.model_validate({"grpo": {"max_val_samples": 4, "val_batch_size": 2}})


def _val_loader() -> list[BatchedDataDict]:
    return [BatchedDataDict(batch=torch.tensor([b, b])) for b in range(2)]


class _ValActor:
    """rollout_to_tq for validation: batch b's rows get VAL_REWARDS[b]."""

    def __init__(self) -> None:
        self.partitions: list[str] = []

    def rollout_to_tq(self, batch: BatchedDataDict, *, partition_id: str, **kwargs: Any) -> tuple[Any, ...]:
        self.partitions.append(partition_id)
        b = int(batch["batch"][0])
        carry = BatchedDataDict(
            total_reward=torch.tensor(VAL_REWARDS[b]), message_log=[[{"role": "assistant", "content": "x"}]] * 2
        )
        meta = KVBatchMeta(partition_id, [f"v{b}_{i}" for i in range(2)], sequence_lengths=[4, 4])
        return meta, encode_carry(carry, kwargs["group_size"]), {"mean_gen_tokens_per_sample": VAL_LENGTHS[b]}


class _ValPolicy:
    def __init__(self) -> None:
        self.finished: list[str] = []

    def prepare_val_partition(self, num_samples: int, *, partition_id: str = "val") -> None:
        assert num_samples == 2

    def finish_step(self, meta: KVBatchMeta) -> None:
        self.finished.extend(meta.keys)


EXPECTED_VAL = {"accuracy": 0.75, "avg_length": 4.0, "num_samples": 4}


def test_validate_sync_returns_metrics_and_timing() -> None:
    actor, policy = _ValActor(), _ValPolicy()
    out = validate_sync(
        rollout_actor=actor,  # type: ignore[arg-type]
        policy=policy,  # type: ignore[arg-type]
        val_dataloader=_val_loader(),  # type: ignore[arg-type]
        val_task_to_env={},
        step=3,
        master_config=_val_config(),
    )
    assert isinstance(out, tuple) and len(out) == 2
    val_metrics, timing_metrics = out
    assert val_metrics == EXPECTED_VAL
    assert set(timing_metrics) == {"total_validation_time"} and timing_metrics["total_validation_time"] >= 0.0
    assert actor.partitions == ["val", "val"] and policy.finished == ["v0_0", "v0_1", "v1_0", "v1_1"]
    no_data = validate_sync(
        rollout_actor=actor,  # type: ignore[arg-type]
        policy=policy,  # type: ignore[arg-type]
        val_dataloader=None,
        val_task_to_env={},
        step=3,
        master_config=_val_config(),
    )
    assert no_data == ({}, {})


def test_legacy_validate_returns_the_same_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """`grpo.validate`, the function validate_sync is the data-plane counterpart of, returns the same shape and
    numbers."""

    def rollout(generation: Any, repeated: BatchedDataDict, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        b = int(repeated["batch"][0])
        repeated["total_reward"] = torch.tensor(VAL_REWARDS[b])
        repeated["message_log"] = [[{"role": "assistant", "content": "x"}]] * 2
        return repeated, {"mean_gen_tokens_per_sample": VAL_LENGTHS[b]}

    monkeypatch.setattr(validation, "run_multi_turn_rollout", rollout)
    assert grpo.validate is validation.validate and grpo_sync.validate_sync is validation.validate_sync
    val_metrics, timing_metrics = grpo.validate(None, _val_loader(), None, {}, 3, _val_config())  # type: ignore[arg-type]
    assert val_metrics == EXPECTED_VAL and set(timing_metrics) == {"total_validation_time"}
    assert grpo.validate(None, None, None, None, 3, _val_config()) == ({}, {})  # type: ignore[arg-type]


class _Logger:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int, str]] = []

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        self.calls.append((dict(metrics), step, prefix))


class _Generation:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def prepare_for_generation(self) -> bool:
        self.events.append("prepare")
        return True

    def finish_generation(self) -> bool:
        self.events.append("finish")
        return True


def test_validation_runner_logs_timing_then_metrics() -> None:
    """The trainers' validation: generation prepared around it, timing under timing/validation, metrics under
    validation (what the trainer loop logs, unchanged by validate's pair)."""
    events: list[str] = []
    logger = _Logger()
    run = validation.validation_runner(
        _Generation(events),  # type: ignore[arg-type]
        logger,  # type: ignore[arg-type]
        lambda step: (events.append(f"validate {step}") or {"accuracy": 0.5}, {"total_validation_time": 1.5}),
    )
    assert run(7) == {"accuracy": 0.5}
    assert events == ["prepare", "validate 7", "finish"]
    assert logger.calls == [
        ({"total_validation_time": 1.5}, 7, "timing/validation"),
        ({"accuracy": 0.5}, 7, "validation"),
    ]
    quiet = validation.validation_runner(_Generation([]), logger, lambda step: ({}, {}))  # type: ignore[arg-type]
    assert quiet(8) == {} and len(logger.calls) == 2  # nothing validated: nothing logged


# ---------------------------------------------------------------------------------------------- penalties
def test_message_level_penalty_refusal_names_the_grpo_keys() -> None:
    _raise_if_message_level_advantage_penalties_enabled(MasterConfig())  # none set: nothing raised
    both = MasterConfig.model_validate(
        {"grpo": {"invalid_tool_call_advantage": -5.0, "malformed_thinking_advantage": -7.0}}
    )
    expected = r"\(grpo\.invalid_tool_call_advantage, grpo\.malformed_thinking_advantage\).*data_plane\.enabled=true"
    with pytest.raises(NotImplementedError, match=expected):
        _raise_if_message_level_advantage_penalties_enabled(both)
    legacy_spelling = MasterConfig.model_validate({"reward_penalties": {"malformed_thinking_advantage": -7.0}})
    with pytest.raises(NotImplementedError, match=r"\(reward_penalties\.malformed_thinking_advantage\)"):
        _raise_if_message_level_advantage_penalties_enabled(legacy_spelling)


def test_grpo_penalty_keys_drive_the_legacy_penalties() -> None:
    from relayrl.algorithms.advantages import message_level_advantages

    cfg = MasterConfig.model_validate(
        {"grpo": {"invalid_tool_call_advantage": -5.0}, "reward_penalties": {"malformed_thinking_advantage": -7.0}}
    )
    assert message_level_advantages(cfg) == {"is_invalid_tool_call": -5.0, "has_malformed_thinking": -7.0}
    assert list(message_level_advantages(cfg)) == ["is_invalid_tool_call", "has_malformed_thinking"]  # first wins
    with pytest.raises(ValueError, match="grpo.invalid_tool_call_advantage and reward_penalties.invalid_tool_call"):
        MasterConfig.model_validate(
            {"grpo": {"invalid_tool_call_advantage": -5.0}, "reward_penalties": {"invalid_tool_call_advantage": -1.0}}
        )


# ---------------------------------------------------------------------------------------------- dynamic sampling
class _DiscardRecorder:
    """The one policy method dynamic sampling uses, with the seed's parameter names."""

    def __init__(self) -> None:
        self.discarded: list[tuple[list[str], str]] = []

    def discard_samples(self, sample_ids: list[str], partition_id: str) -> None:
        self.discarded.append((list(sample_ids), partition_id))


def test_dynamic_sampling_discards_filtered_sample_ids() -> None:
    meta = KVBatchMeta("train", ["a_g0", "a_g1", "b_g0", "b_g1"], sequence_lengths=[4] * 4)
    meta.stamp_tags({"std": [0.0, 0.0, 0.5, 0.5]})  # group a has one reward for both rows: filtered
    carry = BatchedDataDict(total_reward=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    policy = _DiscardRecorder()
    out = _apply_dynamic_sampling(
        meta=meta,
        driver_carry=carry,
        pending_meta=None,
        pending_carry=None,
        pending_unfiltered_rewards=[],
        train_prompts_size=2,
        num_gen_batches=1,
        max_gen_batches=3,
        policy=policy,  # type: ignore[arg-type]
    )
    pending_meta, pending_carry, pending_rewards, complete, ds_metrics, unfiltered = out
    assert policy.discarded == [(["a_g0", "a_g1"], "train")]
    assert complete and pending_meta is not None and pending_meta.keys == ["b_g0", "b_g1"]
    assert pending_carry is not None and pending_carry["filtered_reward"].tolist() == [1.0, 0.0]
    assert pending_rewards == [] and ds_metrics["dynamic_sampling_num_gen_batches"] == 1
    assert unfiltered is not None and unfiltered.tolist() == [1.0, 1.0, 1.0, 0.0]

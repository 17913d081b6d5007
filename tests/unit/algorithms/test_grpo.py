"""Phase functions of the legacy GRPO trainer."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.grpo import dynamic_sampling
from relayrl.algorithms.reward_functions import post_process_rewards
from relayrl.algorithms.runner import early_stop_reached, should_validate
from relayrl.algorithms.trainer_common import first_assistant_lengths, resolve_logprob_skip_flags
from relayrl.config import MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict


def _cfg(**grpo) -> MasterConfig:
    base = {"num_prompts_per_step": 2, "num_generations_per_prompt": 3}
    base.update(grpo)
    return MasterConfig.model_validate(
        {"grpo": base, "policy": {"train_global_batch_size": 6, "train_micro_batch_size": 6}}
    )


def _batch(rewards: list[float]) -> BatchedDataDict:
    n = len(rewards)
    return BatchedDataDict(
        total_reward=torch.tensor(rewards),
        prompt_ids=torch.arange(n).unsqueeze(1) // 3,
        mask_sample=torch.tensor([i % 2 == 1 for i in range(n)]),
        text=[f"r{i}" for i in range(n)],
    )


def test_dynamic_sampling_disabled_passes_batch_through():
    cfg = _cfg(use_dynamic_sampling=False)
    b = _batch([1, 0, 1, 0, 0, 0])
    std = torch.tensor([0.5] * 3 + [0.0] * 3)
    out, complete, cache, metrics = dynamic_sampling(b, std, torch.zeros(6), 1, cfg)
    assert complete and cache is None and metrics == {} and out.size == 6
    assert torch.equal(out["std"], std)


def test_dynamic_sampling_keeps_all_when_every_group_has_signal():
    cfg = _cfg(use_dynamic_sampling=True)
    std = torch.tensor([0.5] * 3 + [0.25] * 3)
    out, complete, cache, metrics = dynamic_sampling(_batch([1, 0, 1, 0, 1, 1]), std, torch.zeros(6), 1, cfg)
    assert complete and cache is None and out.size == 6
    assert metrics["dynamic_sampling_num_discarded_valid_samples"] == 0


def test_dynamic_sampling_accumulates_then_completes_and_rows_stay_aligned():
    cfg = _cfg(use_dynamic_sampling=True)
    std = torch.tensor([0.0] * 3 + [0.25] * 3)
    b = _batch([0.0, 0.0, 0.0, 0.5, 0.5, 0.0])
    out, complete, cache, _ = dynamic_sampling(b, std, torch.zeros(6), 1, cfg)
    assert not complete and cache is not None and cache.size == 3
    assert cache["filtered_reward"].tolist() == [0.5, 0.5, 0.0]
    assert cache["text"] == ["r3", "r4", "r5"] and cache["mask_sample"].tolist() == [True, False, True]
    out, complete, cache2, metrics = dynamic_sampling(
        _batch([0.0, 0.0, 0.0, 0.5, 0.5, 0.0]), std, torch.zeros(6), 2, cfg, cache
    )
    assert complete and cache2 is None and out.size == 6
    assert out["text"] == ["r3", "r4", "r5", "r3", "r4", "r5"]
    assert metrics["dynamic_sampling_num_gen_batches"] == 2


def test_dynamic_sampling_discards_extra_rows_and_counts_them():
    cfg = MasterConfig.model_validate(
        {
            "grpo": {"num_prompts_per_step": 1, "num_generations_per_prompt": 3, "use_dynamic_sampling": True},
            "policy": {"train_global_batch_size": 3, "train_micro_batch_size": 3},
        }
    )
    std = torch.tensor([0.5] * 6)
    out, complete, _, metrics = dynamic_sampling(_batch([1, 0, 1, 0, 1, 1]), std, torch.zeros(6), 1, cfg)
    assert complete and out.size == 3 and metrics["dynamic_sampling_num_discarded_valid_samples"] == 3


def test_dynamic_sampling_raises_after_max_gen_batches():
    cfg = _cfg(use_dynamic_sampling=True, dynamic_sampling_max_gen_batches=2)
    std = torch.zeros(6)
    cache = None
    for n in (1, 2):
        _, complete, cache, _ = dynamic_sampling(_batch([0] * 6), std, torch.zeros(6), n, cfg, cache)
        assert not complete
    with pytest.raises(ValueError, match="dynamic_sampling_max_gen_batches=2"):
        dynamic_sampling(_batch([0] * 6), std, torch.zeros(6), 3, cfg, cache)


def test_validation_cadence():
    cfg = _cfg(val_period=2, val_start_at=3, val_at_end=False)
    assert [s for s in range(1, 6) if should_validate(s, cfg, is_last_step=(s == 5))] == [4]
    cfg = _cfg(val_period=2, val_start_at=3, val_at_end=True)
    assert [s for s in range(1, 6) if should_validate(s, cfg, is_last_step=(s == 5))] == [4, 5]
    cfg = _cfg(val_period=0, val_at_end=False)
    assert not any(should_validate(s, cfg, False) for s in range(1, 10))


def test_early_stop():
    cfg = _cfg(stop_at_validation_metric="accuracy", stop_at_validation_threshold=0.5)
    assert early_stop_reached({"accuracy": 0.75}, cfg)
    assert not early_stop_reached({"accuracy": 0.25}, cfg)
    with pytest.raises(KeyError, match="stop_at_validation_metric"):
        early_stop_reached({"avg_length": 3.0}, cfg)
    assert not early_stop_reached({"accuracy": 1.0}, _cfg())


def test_logprob_skip_flags():
    # default: one optimizer step per rollout batch -> the prev pass is skipped (ratio forced on-policy)
    assert resolve_logprob_skip_flags(MasterConfig()) == (True, False)
    off = MasterConfig.model_validate({"grpo": {"skip_prev_logprobs_when_on_policy": False}})
    assert resolve_logprob_skip_flags(off) == (False, False)
    two_steps = MasterConfig.model_validate({"policy": {"train_global_batch_size": 64, "train_micro_batch_size": 64}})
    assert resolve_logprob_skip_flags(two_steps) == (False, False)
    cfg = MasterConfig.model_validate({"loss_fn": {"force_on_policy_ratio": True}})
    assert resolve_logprob_skip_flags(cfg) == (True, False)
    cfg = MasterConfig.model_validate(
        {"loss_fn": {"force_on_policy_ratio": True}, "grpo": {"seq_logprob_error_threshold": 2.0}}
    )  # the threshold needs prev logprobs: computed despite the forced ratio
    with pytest.warns(UserWarning):
        assert resolve_logprob_skip_flags(cfg) == (False, False)
    cfg = MasterConfig.model_validate(
        {"loss_fn": {"reference_policy_kl_penalty": 0.0}, "grpo": {"skip_prev_logprobs_when_on_policy": False}}
    )
    assert resolve_logprob_skip_flags(cfg) == (False, True)


def test_first_assistant_lengths_and_shaping():
    logs = [
        [{"role": "user", "token_ids": torch.zeros(3)}, {"role": "assistant", "token_ids": torch.zeros(10)}],
        [{"role": "user", "token_ids": torch.zeros(3)}, {"role": "assistant", "token_ids": torch.zeros(22)}],
        [{"role": "user", "token_ids": torch.zeros(3)}, {"role": "assistant", "token_ids": torch.zeros(25)}],
        [
            {"role": "user", "token_ids": torch.zeros(3)},
            {"role": "assistant", "token_ids": torch.zeros(30)},
            {"role": "assistant", "token_ids": torch.zeros(99)},
        ],
    ]
    assert first_assistant_lengths(logs).tolist() == [10, 22, 25, 30]
    cfg = MasterConfig.model_validate(
        {
            "grpo": {
                "reward_shaping": {
                    "enabled": True,
                    "overlong_buffer_length": 5,
                    "overlong_buffer_penalty": 0.5,
                    "max_response_length": 25,
                }
            }
        }
    )
    shaped, unshaped = post_process_rewards(
        torch.tensor([1.0, 0.8, 0.6, 0.4]),
        torch.zeros(4, dtype=torch.bool),
        lambda: first_assistant_lengths(logs),
        cfg.grpo,
    )
    assert torch.allclose(shaped, torch.tensor([1.0, 0.6, 0.1, -0.6]))
    assert unshaped is not None and torch.allclose(unshaped, torch.tensor([1.0, 0.8, 0.6, 0.4]))
    with pytest.raises(ValueError, match="no assistant message"):
        first_assistant_lengths([[{"role": "user", "token_ids": torch.zeros(2)}]])


def test_dynamic_sampling_refuses_a_timer_where_the_cache_goes():
    """The reference passes a timer as the sixth argument; here it would have become the batch cache, silently."""
    from relayrl.utils.timer import Timer

    cfg = _cfg(use_dynamic_sampling=True)
    with pytest.raises(TypeError, match="batch_cache must be a BatchedDataDict or None, got Timer"):
        dynamic_sampling(_batch([0.5] * 6), torch.ones(6), torch.zeros(6), 1, cfg, Timer())

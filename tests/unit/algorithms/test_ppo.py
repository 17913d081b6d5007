"""The legacy PPO loop on a real tiny policy and critic.

Generation is scripted (which rows end properly and which run out of tokens is fixed per row) so that overlong
filtering is exercised deterministically; the policy, the critic, their losses and the trainer are the real ones.
Spies around the policy and the critic record what the trainer hands them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from relayrl.algorithms.gae import (
    GeneralizedAdvantageEstimator,
    RawRewardAdvantageEstimator,
    build_ppo_advantage_estimator,
    compute_gae,
)
from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.algorithms.ppo import (
    build_ppo_train_data,
    ppo_train,
)
from relayrl.algorithms.value_loss import MseValueLossFn
from relayrl.config import ClippedPGLossConfig, MasterConfig, PPOAdvEstimatorConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from relayrl.experience.data import PromptDataset, rl_collate_fn
from relayrl.experience.records import PromptRecord
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.value.lm_value import Value
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState
from relayrl.utils.logger import Logger
from tests.helpers import ScriptedGenerationBase, scripted_generation_output

ROWS = 4  # 2 prompts x 2 generations


class ScriptedGeneration(ScriptedGenerationBase):
    """Row i of every call answers "7" + eos, or (when truncated[i]) "12345" without eos, with logprob -1."""

    def __init__(self, tokenizer: Any, truncated: list[bool]) -> None:
        self.tokenizer = tokenizer
        self.truncated = truncated
        self.calls = 0

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        self.calls += 1
        ids = data["input_ids"]  # [B, S]
        replies, truncated = [], []
        for i in range(ids.shape[0]):
            trunc = self.truncated[i % len(self.truncated)]
            text_ids = self.tokenizer("12345" if trunc else "7", add_special_tokens=False)["input_ids"]
            replies.append(text_ids if trunc else [*text_ids, self.tokenizer.eos_token_id])
            truncated.append(trunc)
        return scripted_generation_output(
            data, replies, truncated, pad_id=self.tokenizer.pad_token_id, logprobs=lambda n: torch.full((n,), -1.0)
        )


class SevenEnv(EnvironmentInterface):
    """Reward 1 when the last assistant message contains a 7."""

    def step(self, message_log_batch: list, metadata: list) -> EnvironmentReturn:
        rewards = torch.tensor([float("7" in log[-1]["content"]) for log in message_log_batch])
        n = len(message_log_batch)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "ok"}] * n,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=rewards,
            terminateds=torch.ones(n, dtype=torch.bool),
        )


class Spy:
    """Delegates to the wrapped model and records every train() batch and every get_values() result."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.train_batches: list[BatchedDataDict] = []
        self.value_outputs: list[torch.Tensor] = []

    def train(self, data: BatchedDataDict, loss_fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.train_batches.append(BatchedDataDict({k: v.clone() for k, v in data.items()}))
        return self.inner.train(data, loss_fn, *args, **kwargs)

    def get_values(self, data: BatchedDataDict, *args: Any, **kwargs: Any) -> BatchedDataDict:
        out = self.inner.get_values(data, *args, **kwargs)
        self.value_outputs.append(out["values"].clone())
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _cfg(model_dir: Any, **ppo: Any) -> MasterConfig:
    batch = {"train_global_batch_size": ROWS, "train_micro_batch_size": 2}
    base = {
        "num_prompts_per_step": 2,
        "num_generations_per_prompt": 2,
        "max_num_steps": 2,
        "val_at_start": False,
        "val_at_end": False,
        "val_period": 0,
    }
    base.update(ppo)
    return MasterConfig.model_validate(
        {
            "algorithm": "ppo",
            "ppo": base,
            "policy": {
                "model_name": str(model_dir),
                "optimizer": {"kwargs": {"lr": 1e-3}},
                "generation": {"logprob_error_alarm": "off"},  # scripted replies carry made-up log-probs (-1)
                **batch,
            },
            "value": {"model_name": str(model_dir), **batch},
            "loss_fn": {"reference_policy_kl_penalty": 0.0},
            "checkpointing": {"enabled": False},
            "logger": {"tensorboard_enabled": False, "progress_bar": False},
        }
    )


def _run(cfg: MasterConfig, tokenizer: Any, tmp_path: Any, truncated: list[bool]) -> tuple[Spy, Spy, Policy]:
    records = [PromptRecord(answer=str(a + 1), task="seven", prompt=f"{a}+1=") for a in range(10, 14)]
    dataset = PromptDataset(records, tokenizer, max_prompt_length=32)
    loader = DataLoader(dataset, batch_size=cfg.ppo.prompts_per_batch, collate_fn=rl_collate_fn)
    policy = Policy(cfg.policy, tokenizer, cluster=cfg.cluster, init_reference_model=False)
    value = Value(cfg.value, tokenizer, cluster=cfg.cluster)
    policy_spy, value_spy = Spy(policy), Spy(value)
    logger = Logger(cfg.logger, tmp_path / "run")
    try:
        ppo_train(
            policy_spy,
            ScriptedGeneration(tokenizer, truncated),
            value_spy,
            loader,
            None,
            tokenizer,
            ClippedPGLossFn(cfg.loss_fn),
            MseValueLossFn(),
            {"seven": SevenEnv()},
            None,
            logger,
            CheckpointManager(cfg.checkpointing, tmp_path / "ckpt"),
            GRPOSaveState(),
            cfg,
        )
    finally:
        logger.close()
    return policy_spy, value_spy, policy


def test_two_ppo_epochs_train_both_models_twice_per_step_on_the_same_advantages(
    tmp_path, tiny_model_dir, char_tokenizer
):
    cfg = _cfg(tiny_model_dir, ppo_epochs=2)
    policy_spy, value_spy, _ = _run(cfg, char_tokenizer, tmp_path, [False, True])
    assert len(value_spy.train_batches) == 4 and len(policy_spy.train_batches) == 4  # 2 steps x 2 epochs
    for step in range(2):
        p0, p1 = policy_spy.train_batches[2 * step : 2 * step + 2]
        v0, v1 = value_spy.train_batches[2 * step : 2 * step + 2]
        for key in ("advantages", "returns", "values", "prev_logprobs", "sample_mask"):
            assert torch.equal(p0[key], p1[key]) and torch.equal(v0[key], v1[key]) and torch.equal(p0[key], v0[key])
        # The critic's predictions (before this step's update) are what the trainers see as `values`.
        assert torch.equal(v0["values"], value_spy.value_outputs[step])
        mask = v0["token_mask"] * v0["sample_mask"].unsqueeze(-1)  # [B, S]
        expected_adv, expected_ret = GeneralizedAdvantageEstimator(1.0, 0.95, True).compute_advantage(
            torch.zeros(ROWS, 1), v0["rewards"], mask, v0["values"]
        )
        assert torch.allclose(v0["advantages"], expected_adv) and torch.allclose(v0["returns"], expected_ret)
    assert torch.equal(value_spy.train_batches[0]["rewards"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert value_spy.inner.weights_version == 4  # one optimizer step per train() call (gbs = all rows)


def test_critic_warmup_trains_only_the_value_model_first(tmp_path, tiny_model_dir, char_tokenizer):
    cfg = _cfg(tiny_model_dir, ppo_epochs=2, policy_training_start_step=1)
    policy_spy, value_spy, policy = _run(cfg, char_tokenizer, tmp_path, [False, True])
    assert len(value_spy.train_batches) == 4  # every epoch of both steps
    assert len(policy_spy.train_batches) == 2  # only step 2 (total_steps 1 >= policy_training_start_step 1)
    assert policy.weights_version == 2
    assert torch.equal(policy_spy.train_batches[0]["advantages"], value_spy.train_batches[2]["advantages"])


def test_overlong_filtering_masks_truncated_rows(tmp_path, tiny_model_dir, char_tokenizer):
    cfg = _cfg(tiny_model_dir, overlong_filtering=True, max_num_steps=1)
    policy_spy, value_spy, _ = _run(cfg, char_tokenizer, tmp_path, [False, True])
    data = value_spy.train_batches[0]
    assert data["sample_mask"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert torch.equal(policy_spy.train_batches[0]["sample_mask"], data["sample_mask"])
    assert (data["advantages"][[1, 3]] == 0).all() and (data["advantages"][[0, 2]] != 0).any()
    assert (data["token_mask"][[1, 3]].sum(dim=1) > 0).all()  # still response tokens, just not trained on

    unfiltered = _cfg(tiny_model_dir, overlong_filtering=False, max_num_steps=1)
    _, value_spy, _ = _run(unfiltered, char_tokenizer, tmp_path, [False, True])
    assert value_spy.train_batches[0]["sample_mask"].tolist() == [1.0] * ROWS


def test_all_truncated_batch_raises(tmp_path, tiny_model_dir, char_tokenizer):
    cfg = _cfg(tiny_model_dir, overlong_filtering=True, max_num_steps=1)
    with pytest.raises(RuntimeError, match="no valid response tokens"):
        _run(cfg, char_tokenizer, tmp_path, [True])


def test_train_data_masks_every_assistant_message(char_tokenizer):
    """Assistant messages are trained even without generation logprobs, unlike GRPO."""
    tok = char_tokenizer
    ids = lambda s: torch.tensor(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    log = [
        {"role": "user", "content": "ab", "token_ids": ids("ab")},
        {"role": "assistant", "content": "cd", "token_ids": ids("cd")},  # e.g. a replayed turn: no logprobs
        {"role": "assistant", "content": "e", "token_ids": ids("e"), "generation_logprobs": torch.tensor([-0.5])},
    ]
    batch = BatchedDataDict(message_log=[log], loss_multiplier=torch.ones(1), truncated=torch.tensor([True]))
    cfg = _cfg("unused", overlong_filtering=True)
    data, metrics = build_ppo_train_data(batch, torch.tensor([2.0]), tok.pad_token_id, cfg)
    assert data["token_mask"].tolist() == [[0, 0, 1, 1, 1]]
    assert data["generation_logprobs"].tolist() == [[0.0, 0.0, 0.0, 0.0, -0.5]]
    assert data["sample_mask"].tolist() == [0.0] and metrics["num_overlong_filtered"] == 1.0
    assert data["rewards"].tolist() == [2.0]


def test_estimator_factory_and_raw_reward():
    loss = ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
    assert isinstance(build_ppo_advantage_estimator(PPOAdvEstimatorConfig(), loss), GeneralizedAdvantageEstimator)
    raw = build_ppo_advantage_estimator(PPOAdvEstimatorConfig(name="raw_reward", normalize_advantages=False), loss)
    assert isinstance(raw, RawRewardAdvantageEstimator)
    with pytest.raises(ValueError, match="only supports 'gae' or 'raw_reward'"):
        build_ppo_advantage_estimator(PPOAdvEstimatorConfig.model_construct(name="grpo"), loss)

    rewards, values = torch.tensor([2.0, -1.0]), torch.tensor([[0.0, 0.5, 0.25], [0.0, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    adv, returns = raw.compute_advantage(torch.zeros(2, 1), rewards, mask, values)
    assert adv.tolist() == [[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]]  # broadcast, masked positions included
    assert torch.allclose(returns * mask, torch.tensor([[0.0, 2.0, 2.0], [0.0, -1.0, 0.0]]))  # reward-to-go (gamma 1)
    assert torch.allclose(returns, compute_gae(rewards, values, mask, 1.0, 1.0)[1])


def test_rollout_block_is_the_ppo_block():
    """Rollout, validation and data code read `cfg.rollout`, which is the PPO block in a PPO run: no GRPO view."""
    cfg = _cfg("unused", val_period=3, overlong_filtering=True, seed=7, max_val_samples=40, val_batch_size=20)
    assert cfg.rollout is cfg.ppo
    assert cfg.rollout.val_period == 3 and cfg.rollout.seed == 7 and cfg.rollout.overlong_filtering
    assert cfg.rollout.rows_per_step == 2 * cfg.ppo.num_generations_per_prompt and cfg.rollout.max_val_samples == 40
    assert cfg.grpo.val_period != 3  # the GRPO block keeps its own values


def _train_metrics(tmp_path: Any) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/reward" in r]


def _prompts(tokenizer: Any, data: BatchedDataDict) -> list[str]:
    return [tokenizer.decode(row).split("+1=")[0][-2:] for row in data["input_ids"].tolist()]


def test_dynamic_sampling_drops_flat_groups_before_the_critic_and_refills(tmp_path, tiny_model_dir, char_tokenizer):
    """Prompts 10..13, two rows each: row 0 of every generation batch answers 7 (reward 1), the rest run out of
    tokens (reward 0). Batch 1 (10, 11) keeps 10's group, drops 11's flat one; batch 2 (12, 13) keeps 12's. The
    critic scores only the 4 kept rows, once, and GAE runs on them alone."""
    cfg = _cfg(tiny_model_dir, use_dynamic_sampling=True, max_num_steps=1)
    policy_spy, value_spy, _ = _run(cfg, char_tokenizer, tmp_path, [False, True, True, True])
    data = value_spy.train_batches[0]
    assert _prompts(char_tokenizer, data) == ["10", "10", "12", "12"]
    assert data["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert len(value_spy.value_outputs) == 1 and value_spy.value_outputs[0].shape[0] == ROWS
    mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)  # [B, S]
    adv, ret = GeneralizedAdvantageEstimator(1.0, 0.95, True).compute_advantage(
        torch.zeros(ROWS, 1), data["rewards"], mask, value_spy.value_outputs[0]
    )
    assert torch.equal(data["advantages"], adv) and torch.equal(data["returns"], ret)
    (m,) = _train_metrics(tmp_path)
    assert (
        m["train/dynamic_sampling_num_gen_batches"] == 2
        and m["train/dynamic_sampling_num_discarded_valid_samples"] == 0
    )
    assert (m["train/reward"], m["train/filtered_reward"]) == (0.25, 0.5)  # all 8 generated rows; the 4 trained


def test_dynamic_sampling_batch_multiplier_discards_the_surplus(tmp_path, tiny_model_dir, char_tokenizer):
    """batch_multiplier 2: one generation batch of 4 prompts, every group mixed (1, 0): 8 rows survive, the first 4
    (prompts 10, 11) train and 4 are discarded and counted."""
    cfg = _cfg(tiny_model_dir, use_dynamic_sampling=True, batch_multiplier=2, max_num_steps=1)
    _, value_spy, _ = _run(cfg, char_tokenizer, tmp_path, [False, True])
    assert _prompts(char_tokenizer, value_spy.train_batches[0]) == ["10", "10", "11", "11"]
    (m,) = _train_metrics(tmp_path)
    assert (
        m["train/dynamic_sampling_num_gen_batches"] == 1
        and m["train/dynamic_sampling_num_discarded_valid_samples"] == 4
    )


def test_dynamic_sampling_stops_past_its_generation_batch_limit(tmp_path, tiny_model_dir, char_tokenizer):
    cfg = _cfg(tiny_model_dir, use_dynamic_sampling=True, dynamic_sampling_max_gen_batches=1, max_num_steps=1)
    with pytest.raises(ValueError, match=r"\(ppo.dynamic_sampling_max_gen_batches=1\) with only 0/4 rows"):
        _run(cfg, char_tokenizer, tmp_path, [True])  # every reward 0: no group has spread

"""RewardModelEnvironment: rewards are the classifier's scores of the rendered conversations, in row order."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from relayrl.environments.reward_model_env import (
    RewardModelEnvConfig,
    RewardModelEnvironment,
    concatenation_renderer,
)
from relayrl.models.policy.reward_model import RewardModelPolicy
from tests.helpers import save_test_reward_model

CONVERSATIONS = [
    [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}],
    [{"role": "user", "content": "50-7="}, {"role": "assistant", "content": "43"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "9+9="},
        {"role": "assistant", "content": "x"},
    ],
    [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "a much longer wrong answer: 3"}],
]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory, char_tokenizer) -> Path:
    return save_test_reward_model(tmp_path_factory.mktemp("env_rm"), char_tokenizer, seed=3, score_std=1.0)


@pytest.fixture(scope="module")
def rm(rm_dir) -> RewardModelPolicy:
    return RewardModelPolicy(rm_dir, micro_batch_size=3)


def one_by_one_scores(rm: RewardModelPolicy, tokenizer, texts: list[str]) -> torch.Tensor:
    """Each text tokenized and scored alone by the classifier's own forward (no padding at all)."""
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            out.append(rm.model(input_ids=ids).logits[0, 0])
    return torch.stack(out)


def test_rewards_are_scores_in_row_order(rm, char_tokenizer) -> None:
    env = RewardModelEnvironment(rm, char_tokenizer)
    metadata = [{"ground_truth": "46"}, None, {"k": 1}, {"ground_truth": "2"}]
    ret = env.step(CONVERSATIONS, metadata)
    texts = [char_tokenizer.apply_chat_template(c, tokenize=False) for c in CONVERSATIONS]
    assert texts[0] == "<|user|>12+34=<|end|><|assistant|>46<|end|>"
    want = one_by_one_scores(rm, char_tokenizer, texts)
    assert ret.rewards.dtype == torch.float32 and ret.rewards.shape == (4,)
    assert (ret.rewards - want).abs().max() <= 1e-5 and ret.rewards.std() > 0.1
    assert torch.equal(ret.terminateds, torch.ones(4, dtype=torch.bool))
    assert ret.observations == [{"role": "environment", "content": f"Reward: {float(r):.3f}"} for r in ret.rewards]
    assert ret.metadata == metadata and ret.next_stop_strings == [None] * 4 and ret.answers is None
    # reversing the rows reverses the rewards
    back = env.step(CONVERSATIONS[::-1], metadata[::-1])
    assert (back.rewards - ret.rewards.flip(0)).abs().max() <= 1e-5
    assert env.last_metrics["reward_model_score_mean"] == pytest.approx(float(want.mean()), abs=1e-5)


def test_normalize_and_custom_renderer(rm, char_tokenizer) -> None:
    raw = RewardModelEnvironment(rm, char_tokenizer).step(CONVERSATIONS, [None] * 4).rewards
    norm = RewardModelEnvironment(rm, char_tokenizer, normalize=True).step(CONVERSATIONS, [None] * 4).rewards
    want = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)
    assert (norm - want).abs().max() <= 1e-5 and abs(float(norm.mean())) < 1e-5
    # A prompt already rendered by the dataset (as relayrl's PromptDataset stores it) plus the generated text.
    logs = [[{"role": "user", "content": "<|user|>12+34=<|end|><|assistant|>"}, {"role": "assistant", "content": "46"}]]
    env = RewardModelEnvironment(rm, char_tokenizer, render=concatenation_renderer)
    got = env.step(logs, [None]).rewards
    want_one = one_by_one_scores(rm, char_tokenizer, ["<|user|>12+34=<|end|><|assistant|>46"])
    assert (got - want_one).abs().max() <= 1e-5


def test_from_config_and_batch_metrics(rm_dir, char_tokenizer) -> None:
    env = RewardModelEnvironment.from_config(RewardModelEnvConfig(model_dir=str(rm_dir), micro_batch_size=2))
    ret = env.step(CONVERSATIONS[:2], [None, None])
    assert ret.rewards.shape == (2,)
    batch = {"total_reward": torch.tensor([1.0, 3.0, 5.0]), "truncated": torch.tensor([False, True, False])}
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics == {"reward_mean": pytest.approx(2.0), "num_problems_in_batch": 3}
    empty = env.step([], [])
    assert empty.rewards.shape == (0,) and empty.observations == []
    concat = RewardModelEnvironment.from_config(RewardModelEnvConfig(model_dir=str(rm_dir), render="concatenation"))
    log = [
        {"role": "user", "content": "<|user|>1+1=<|end|><|assistant|>"},
        {"role": "assistant", "content": "2<|end|>"},
    ]
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    # the pre-rendered prompt + answer scores like the chat-rendered conversation it spells out
    assert concat.step([log], [None]).rewards[0] == pytest.approx(float(env.step([chat], [None]).rewards[0]), abs=1e-5)
    env.shutdown()


def test_bad_inputs(rm, rm_dir, tiny_model_dir, char_tokenizer, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RewardModelEnvironment.from_config(RewardModelEnvConfig(model_dir=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="not a sequence-classification model"):
        RewardModelEnvironment.from_config(RewardModelEnvConfig(model_dir=str(tiny_model_dir)))
    with pytest.raises(TypeError, match="RewardModelPolicy"):
        RewardModelEnvironment(str(rm_dir), char_tokenizer)  # type: ignore[arg-type]
    no_template = copy.deepcopy(char_tokenizer)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template; pass render"):
        RewardModelEnvironment(rm, no_template)
    env = RewardModelEnvironment(rm, char_tokenizer)
    with pytest.raises(ValueError, match="2 message logs but 1 metadata"):
        env.step(CONVERSATIONS[:2], [None])
    with pytest.raises(ValueError, match="row 0: the rendered conversation has no tokens"):
        RewardModelEnvironment(rm, char_tokenizer, render=lambda _: "").step(CONVERSATIONS[:1], [None])

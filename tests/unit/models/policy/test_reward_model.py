"""RewardModelPolicy: scores equal a direct transformers forward of the classifier at the last real token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForSequenceClassification

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.policy.reward_model import RewardModelPolicy
from tests.helpers import build_reward_classifier

B, S = 6, 10
LENGTHS = torch.tensor([10, 4, 7, 1, 9, 2])


def tiny_classifier(vocab: int, num_labels: int = 1, pad_token_id: int | None = 0) -> Qwen2ForSequenceClassification:
    # score_std 1: spread the scores so row mix-ups cannot hide
    model = build_reward_classifier(vocab, seed=2, score_std=1.0, num_labels=num_labels, pad_token_id=pad_token_id)
    return model.eval()


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory, char_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny_rm")
    tiny_classifier(len(char_tokenizer)).save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path


def make_batch(vocab: int, pad: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (B, S), generator=g)  # [B, S], no pad id among real tokens
    ids = ids.masked_fill(torch.arange(S)[None, :] >= LENGTHS[:, None], pad)
    return BatchedDataDict(input_ids=ids, input_lengths=LENGTHS.clone())


def test_scores_match_direct_forward(rm_dir, char_tokenizer) -> None:
    vocab = len(char_tokenizer)
    rm = RewardModelPolicy(rm_dir)
    assert rm.tokenizer is not None and rm.tokenizer("1+2")["input_ids"] == char_tokenizer("1+2")["input_ids"]
    data = make_batch(vocab)
    got = rm.score(data, micro_batch_size=4)["scores"]
    assert got.shape == (B,) and got.dtype == torch.float32 and got.device.type == "cpu"
    ref = Qwen2ForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    mask = (torch.arange(S)[None, :] < LENGTHS[:, None]).long()
    with torch.no_grad():
        want = ref(input_ids=data["input_ids"], attention_mask=mask).logits[:, 0]  # HF pools at the last non-pad
        one_by_one = torch.stack(
            [ref(input_ids=data["input_ids"][i : i + 1, : int(n)]).logits[0, 0] for i, n in enumerate(LENGTHS)]
        )
    assert (got - want).abs().max() <= 1e-5 and (got - one_by_one).abs().max() <= 1e-5
    assert got.std() > 0.1  # distinct rows
    assert (rm.score(data, micro_batch_size=1)["scores"] - got).abs().max() <= 1e-5


def test_padding_comes_from_input_lengths_not_the_pad_id(rm_dir, char_tokenizer) -> None:
    """HF's own pooling needs pad_token_id and is fooled by a real token equal to it; input_lengths is not."""
    vocab = len(char_tokenizer)
    rm = RewardModelPolicy(rm_dir)
    base = rm.score(make_batch(vocab))["scores"]
    other_pad = rm.score(make_batch(vocab, pad=7))["scores"]  # different padding value, same real tokens
    assert (base - other_pad).abs().max() <= 1e-6
    data = make_batch(vocab)
    data["input_ids"][0, 9] = 0  # the last real token of row 0 happens to be the pad id
    mask = (torch.arange(S)[None, :] < LENGTHS[:, None]).long()
    ref = rm.model
    with torch.no_grad():
        full = ref.score(ref.model(input_ids=data["input_ids"][:1], attention_mask=mask[:1]).last_hidden_state)
    assert rm.score(data)["scores"][0] == pytest.approx(float(full[0, 9, 0]), abs=1e-5)


def test_bad_paths_and_models(rm_dir, tiny_model_dir, char_tokenizer, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RewardModelPolicy(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        RewardModelPolicy(tmp_path)
    with pytest.raises(ValueError, match="not a sequence-classification model.*Qwen2ForCausalLM"):
        RewardModelPolicy(tiny_model_dir)
    three = tmp_path / "three"
    tiny_classifier(len(char_tokenizer), num_labels=3).save_pretrained(three)
    with pytest.raises(ValueError, match="num_labels=3"):
        RewardModelPolicy(three)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((rm_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="cannot load a sequence-classification model"):
        RewardModelPolicy(broken)
    assert json.loads((rm_dir / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    with pytest.raises(ValueError, match="micro_batch_size"):
        RewardModelPolicy(rm_dir, micro_batch_size=0)


def test_bad_batches(rm_dir, char_tokenizer) -> None:
    rm = RewardModelPolicy(rm_dir)
    good = make_batch(len(char_tokenizer))
    with pytest.raises(ValueError, match="missing required key.*input_lengths"):
        rm.score(BatchedDataDict(input_ids=good["input_ids"]))
    with pytest.raises(ValueError, match="row 1 has input_length 0"):
        rm.score(BatchedDataDict(input_ids=good["input_ids"], input_lengths=torch.tensor([3, 0, 1, 1, 1, 1])))
    too_big = good["input_ids"].clone()
    too_big[2, 0] = 10_000
    with pytest.raises(ValueError, match="reward model's vocabulary"):
        rm.score(BatchedDataDict(input_ids=too_big, input_lengths=good["input_lengths"]))
    empty = rm.score(BatchedDataDict(input_ids=torch.zeros(0, S, dtype=torch.long), input_lengths=torch.zeros(0)))
    assert empty["scores"].shape == (0,)

"""Value (the PPO critic) on the local executor, checked against direct forwards of the backbone and head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, Qwen2ForSequenceClassification

from relayrl.algorithms.value_loss import MseValueLossFn, explained_variance
from relayrl.config import ClusterConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.value.lm_value import Value, ValueConfig
from relayrl.models.value.worker import VALUE_HEAD_FILE
from tests.helpers import max_abs_diff, ragged_batch, save_test_reward_model, small_policy_config

B, S = 8, 12
LENGTHS = torch.tensor([12, 5, 7, 2, 12, 9, 3, 10])  # ragged, right-padded
SAMPLE_MASK = torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 1])


def make_config(model_dir: Path, **overrides: Any) -> ValueConfig:
    return small_policy_config(
        model_dir, ValueConfig, **{"train_global_batch_size": 8, "max_grad_norm": 1.0, **overrides}
    )


def make_batch(vocab: int, seed: int = 0) -> BatchedDataDict:
    """LENGTHS rows, row 3 masked out, the first 3 tokens a "prompt" the loss must ignore; returns 0 at padding."""
    data = ragged_batch(vocab, seed, LENGTHS, SAMPLE_MASK, seq_len=S, returns=True, advantages=False)
    data["returns"] = data["returns"] * (torch.arange(S)[None, :] < LENGTHS[:, None])  # [B, S]
    return data


def with_old_values(value: Value, data: BatchedDataDict) -> BatchedDataDict:
    """Add the critic's own values as the `values` the clipped loss clips around (plus a little noise)."""
    data = data.copy()
    v = value.get_values(data)["values"]
    data["values"] = v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(5))
    return data


def weights(value: Value) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in value.state_dict().items()}


def direct_values(backbone: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor, data: BatchedDataDict):
    """Backbone forward with a padding mask, the head applied by hand, then shifted right with a loop."""
    mask = (torch.arange(S)[None, :] < data["input_lengths"][:, None]).long()
    with torch.no_grad():
        hidden = backbone(input_ids=data["input_ids"], attention_mask=mask).last_hidden_state  # [B, S, H]
    head = hidden @ weight[0] + bias[0]  # [B, S]
    want = torch.zeros(B, S)
    for i in range(B):
        for t in range(1, int(data["input_lengths"][i])):
            want[i, t] = head[i, t - 1]
    return want


@pytest.fixture(scope="module")
def vocab(char_tokenizer) -> int:
    return len(char_tokenizer)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory, char_tokenizer) -> Path:
    return save_test_reward_model(tmp_path_factory.mktemp("tiny_rm"), char_tokenizer, seed=1)


# ---------------------------------------------------------------------------------------------- get_values
def test_get_values_match_direct_forward(tiny_model_dir, char_tokenizer, vocab) -> None:
    value = Value(make_config(tiny_model_dir, logprob_batch_size=3), char_tokenizer)
    sd = value.state_dict()
    w, b = sd["score.weight"], sd["score.bias"]
    assert w.shape == (1, 64) and torch.equal(b, torch.zeros(1))
    assert 0.01 < float(w.std()) < 0.03  # N(0, initializer_range=0.02), as transformers initialises the head
    data = make_batch(vocab)
    got = value.get_values(data)["values"]
    assert got.shape == (B, S) and got.dtype == torch.float32 and got.device.type == "cpu"
    backbone = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).model.eval()
    want = direct_values(backbone, w, b, data)
    assert (got - want).abs().max() <= 1e-6
    assert torch.all(got[:, 0] == 0) and torch.all(got[torch.arange(S)[None, :] >= LENGTHS[:, None]] == 0)
    assert got[0, 1:].abs().min() > 0  # real positions carry values
    again = Value(make_config(tiny_model_dir), char_tokenizer)  # deterministic head init: same values
    assert torch.equal(again.get_values(data)["values"], got)


def test_policy_config_accepted_and_two_workers_give_same_values(tiny_model_dir, char_tokenizer, vocab) -> None:
    pcfg = PolicyConfig(model_name=str(tiny_model_dir), train_global_batch_size=8, train_micro_batch_size=2)
    one = Value(pcfg, char_tokenizer)
    assert one.cfg.train_micro_batch_size == 2 and one.cfg.model_name == str(tiny_model_dir)
    two = Value(pcfg, char_tokenizer, cluster=ClusterConfig(workers_per_node=2))
    data = make_batch(vocab)
    data = BatchedDataDict({k: v[:7] for k, v in data.items()})  # uneven shards come back in input order
    assert (one.get_values(data)["values"] - two.get_values(data)["values"]).abs().max() <= 1e-6


def test_critic_can_start_from_a_reward_model(reward_model_dir, char_tokenizer, vocab) -> None:
    value = Value(make_config(reward_model_dir), char_tokenizer)
    rm = Qwen2ForSequenceClassification.from_pretrained(reward_model_dir, dtype=torch.float32).eval()
    sd = value.state_dict()
    assert torch.equal(sd["score.weight"], rm.score.weight) and torch.equal(sd["score.bias"], torch.zeros(1))
    data = make_batch(vocab)
    want = direct_values(rm.model, rm.score.weight.detach(), torch.zeros(1), data)
    assert (value.get_values(data)["values"] - want).abs().max() <= 1e-6


def test_random_init_replicas_start_identical(tiny_model_dir, char_tokenizer) -> None:
    value = Value(
        make_config(tiny_model_dir, random_init=True), char_tokenizer, cluster=ClusterConfig(workers_per_node=2)
    )
    ranks = [value._group.worker(r).state_dict() for r in (0, 1)]  # type: ignore[attr-defined]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    pretrained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    name = "layers.0.mlp.up_proj.weight"
    assert not torch.equal(ranks[0][f"model.{name}"], pretrained.model.state_dict()[name])


def test_bfloat16_autocast_keeps_float32_master_weights(tiny_model_dir, char_tokenizer, vocab) -> None:
    data = make_batch(vocab)
    fp32 = Value(make_config(tiny_model_dir), char_tokenizer).get_values(data)["values"]
    bf16 = Value(make_config(tiny_model_dir, precision="bfloat16"), char_tokenizer)
    got = bf16.get_values(data)["values"]
    assert got.dtype == torch.float32 and 0 < (got - fp32).abs().max() < 0.05
    res = bf16.train(data, MseValueLossFn(), mbs=4)
    assert torch.isfinite(res["loss"]).all() and res["model_dtype"] == "torch.bfloat16"
    assert all(t.dtype == torch.float32 for t in bf16.state_dict().values())


# ---------------------------------------------------------------------------------------------- train
def test_gradient_accumulation_matches_full_batch(tiny_model_dir, char_tokenizer, vocab) -> None:
    loss_fn = MseValueLossFn(scale=1.0, value_clip=0.03)  # old values are 0.05-noisy: some tokens clip
    cfg = make_config(tiny_model_dir, optimizer={"kwargs": {"lr": 1e-4}})

    def train_in_micro_batches_of(mbs: int) -> tuple[dict, dict[str, torch.Tensor]]:
        value = Value(cfg, char_tokenizer)
        res = value.train(with_old_values(value, make_batch(vocab)), loss_fn, gbs=8, mbs=mbs)
        return res, weights(value)

    start = weights(Value(cfg, char_tokenizer))
    (acc, acc_weights), (full, full_weights) = train_in_micro_batches_of(2), train_in_micro_batches_of(8)
    assert acc["loss"].shape == (1,) and torch.allclose(acc["loss"], full["loss"], atol=1e-6)
    assert abs(float(acc["grad_norm"]) - float(full["grad_norm"])) <= 1e-5
    assert max_abs_diff(acc_weights, start) > 5e-5  # the step did something
    assert max_abs_diff(acc_weights, full_weights) <= 1e-6
    assert len(acc["all_mb_metrics"]["loss"]) == 4 and len(full["all_mb_metrics"]["loss"]) == 1
    batch = make_batch(vocab)
    n_tok = float((batch["token_mask"] * batch["sample_mask"][:, None]).sum())
    assert acc["all_mb_metrics"]["global_valid_toks"] == [n_tok] * 4
    assert acc["all_mb_metrics"]["global_valid_seqs"] == [7.0] * 4
    for key in ("loss", "vf_clipfrac", "explained_var", "values_mean", "returns_mean"):
        assert acc["metrics"][key] == pytest.approx(full["metrics"][key], abs=1e-6), key
    assert acc["metrics"]["loss"] == pytest.approx(float(acc["loss"].sum()), abs=1e-6)
    assert 0 < acc["metrics"]["vf_clipfrac"] < 1


def test_metrics_equal_hand_computed_values(tiny_model_dir, char_tokenizer, vocab) -> None:
    value = Value(make_config(tiny_model_dir), char_tokenizer)
    data = make_batch(vocab)
    v = value.get_values(data)["values"]
    res = value.train(data, MseValueLossFn(), eval_mode=True)
    m = data["token_mask"] * data["sample_mask"][:, None]  # [B, S]
    n = m.sum()
    r = data["returns"]
    want_loss = 0.5 * float(((v - r).square() * m).sum() / n)
    assert float(res["loss"][0]) == pytest.approx(want_loss, rel=1e-5)
    got = res["metrics"]
    assert got["values_mean"] == pytest.approx(float((v * m).sum() / n), abs=1e-6)
    assert got["returns_mean"] == pytest.approx(float((r * m).sum() / n), abs=1e-6)
    resid, ret = (r - v)[m > 0], r[m > 0]
    ev = 1 - float(resid.var(unbiased=False) / ret.var(unbiased=False))
    assert got["explained_var"] == pytest.approx(ev, abs=1e-5)
    assert got["explained_var"] == pytest.approx(
        explained_variance(got["returns_mean"], got["values_mean"], got["returns_sq_mean"], got["residual_sq_mean"])
    )
    assert got["vf_clipfrac"] == 0.0 and "grad_norm" not in got and res["grad_norm"] is None
    assert got["values_min"] == pytest.approx(float(v[m > 0].min())) and got["lr"] == pytest.approx(1e-2)


def test_eval_mode_changes_nothing(tiny_model_dir, char_tokenizer, vocab) -> None:
    value = Value(make_config(tiny_model_dir, scheduler={"warmup_steps": 3}), char_tokenizer)
    data = with_old_values(value, make_batch(vocab))
    loss_fn = MseValueLossFn(value_clip=0.2)
    before = weights(value)
    ev = value.train(data, loss_fn, eval_mode=True)
    assert all(torch.equal(before[k], t) for k, t in weights(value).items())
    assert value.weights_version == 0
    tr = value.train(data, loss_fn)
    assert torch.equal(ev["loss"], tr["loss"]) and ev["lr"] == tr["lr"] == pytest.approx(1e-3)
    assert value.weights_version == 1 and float(tr["grad_norm"]) > 0 and tr["metrics"]["grad_norm"] > 0
    assert any(not torch.equal(before[k], t) for k, t in weights(value).items())
    # several global batches: one optimizer step each, empty micro-batches skipped
    data["sample_mask"] = torch.tensor([1.0, 1, 0, 0, 1, 1, 1, 1])
    res = value.train(data, loss_fn, gbs=4, mbs=2)
    assert res["loss"].shape == (2,) and len(res["all_mb_metrics"]["loss"]) == 3 and value.weights_version == 3


def test_two_data_parallel_workers_match_one(tiny_model_dir, char_tokenizer, vocab) -> None:
    loss_fn = MseValueLossFn(value_clip=0.2)
    outs = []
    for workers in (1, 2):
        value = Value(make_config(tiny_model_dir), char_tokenizer, cluster=ClusterConfig(workers_per_node=workers))
        data = with_old_values(value, make_batch(vocab))
        res = value.train(data, loss_fn, gbs=4, mbs=2)
        outs.append((res, weights(value), value.get_values(data)["values"]))
    (r1, w1, v1), (r2, w2, v2) = outs
    assert torch.allclose(r1["loss"], r2["loss"], atol=1e-6)
    assert r2["metrics"]["loss"] == pytest.approx(float(r1["loss"].mean()), abs=1e-6)
    assert all((w1[k] - w2[k]).abs().max() <= 1e-6 for k in w1)
    assert (v1 - v2).abs().max() <= 1e-5


# ---------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_and_exact_resume(tiny_model_dir, char_tokenizer, vocab, tmp_path) -> None:
    cfg = make_config(tiny_model_dir, scheduler={"warmup_steps": 2, "name": "cosine", "decay_steps": 3})
    loss_fn = MseValueLossFn(value_clip=0.2)
    batches = [make_batch(vocab, seed=s) for s in (0, 1)]
    a = Value(cfg, char_tokenizer, max_num_steps=10)
    a.train(with_old_values(a, batches[0]), loss_fn)
    w, o, tok = str(tmp_path / "w"), str(tmp_path / "opt"), str(tmp_path / "tok")
    a.save_checkpoint(w, o, tok)
    assert (tmp_path / "w" / VALUE_HEAD_FILE).is_file() and (tmp_path / "tok" / "tokenizer_config.json").is_file()
    saved = weights(a)
    backbone = AutoModel.from_pretrained(w, dtype=torch.float32)  # the backbone is a plain HF directory
    assert all(torch.equal(saved[f"model.{k}"], t) for k, t in backbone.state_dict().items())

    step2 = with_old_values(a, batches[1])
    b = Value(cfg, char_tokenizer, weights_path=w, optimizer_path=o, max_num_steps=10)
    assert b.weights_version == 1
    assert torch.equal(a.get_values(step2)["values"], b.get_values(step2)["values"])
    res_a, res_b = a.train(step2, loss_fn), b.train(step2, loss_fn)
    assert res_a["lr"] == res_b["lr"] and torch.equal(res_a["loss"], res_b["loss"])
    assert torch.equal(res_a["grad_norm"], res_b["grad_norm"])
    assert all(torch.equal(t, weights(b)[k]) for k, t in weights(a).items())
    # load_checkpoint into a live critic, and model_name pointing at a saved critic
    c = Value(cfg, char_tokenizer, max_num_steps=10)
    c.load_checkpoint(w, o)
    assert all(torch.equal(saved[k], t) for k, t in weights(c).items())
    assert torch.equal(c.train(step2, loss_fn)["loss"], res_a["loss"])
    d = Value(make_config(tmp_path / "w"), char_tokenizer)
    assert all(torch.equal(saved[k], t) for k, t in weights(d).items())


def test_phases_and_shutdown(tiny_model_dir, char_tokenizer, vocab) -> None:
    value = Value(make_config(tiny_model_dir), char_tokenizer)
    data = make_batch(vocab)
    value.prepare_for_inference()
    before = value.get_values(data)["values"]
    value.finish_inference()
    value.prepare_for_training()
    value.train(data, MseValueLossFn())
    value.finish_training()
    value.offload_to_cpu()
    value.prepare_for_inference()
    assert not torch.equal(before, value.get_values(data)["values"])
    assert value.shutdown() is True and value.shutdown() is True
    with pytest.raises(RuntimeError, match="shut down"):
        value.get_values(data)


# ---------------------------------------------------------------------------------------------- errors
def test_bad_paths_configs_and_batches(tiny_model_dir, char_tokenizer, vocab, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Value(make_config(tmp_path / "missing"), char_tokenizer)
    with pytest.raises(ValueError, match="no config.json"):
        Value(make_config(tmp_path), char_tokenizer)
    with pytest.raises(ValueError, match="not a saved value model"):
        Value(make_config(tiny_model_dir), char_tokenizer, weights_path=str(tiny_model_dir))
    (tmp_path / "config.json").write_text((Path(tiny_model_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match="cannot load a language-model backbone"):
        Value(make_config(tmp_path), char_tokenizer)
    with pytest.raises(ValueError, match="hf_config_overrides.*num_hidden_layer'"):
        Value(make_config(tiny_model_dir, hf_config_overrides={"num_hidden_layer": 1}), char_tokenizer)
    with pytest.raises(TypeError, match="value config must be"):
        Value(42, char_tokenizer)
    value = Value(make_config(tiny_model_dir), char_tokenizer, init_optimizer=False)
    good = make_batch(vocab)
    with pytest.raises(ValueError, match="missing required key.*input_lengths"):
        value.get_values(BatchedDataDict({"input_ids": good["input_ids"]}))
    with pytest.raises(ValueError, match="missing required key.*token_mask"):
        value.train(BatchedDataDict({k: t for k, t in good.items() if k != "token_mask"}), MseValueLossFn())
    with pytest.raises(ValueError, match="not a positive multiple of the global batch size 16"):
        value.train(good, MseValueLossFn(), gbs=16)
    with pytest.raises(RuntimeError, match="init_optimizer=False"):
        value.train(good, MseValueLossFn())
    with pytest.raises(ValueError, match="init_optimizer=False"):
        value.save_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"))

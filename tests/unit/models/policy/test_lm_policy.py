"""Policy on the local executor, checked against direct transformers forwards on a tiny Qwen2 loaded from disk."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.algorithms.loss_functions import ClippedPGLossFn, NLLLossFn
from relayrl.config import ClippedPGLossConfig, ClusterConfig, PolicyConfig, SchedulerConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.worker_base import lr_factor

B, S = 8, 12
LENGTHS = torch.tensor([12, 5, 7, 2, 12, 9, 3, 10])  # ragged, right-padded


def make_config(model_dir: Path, **overrides: Any) -> PolicyConfig:
    base: dict[str, Any] = dict(
        model_name=str(model_dir), train_global_batch_size=8, train_micro_batch_size=2, max_grad_norm=1.0
    )
    base["optimizer"] = {"kwargs": {"lr": 1e-2}}
    base.update(overrides)
    return PolicyConfig.model_validate(base)


def make_batch(vocab: int, seed: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (B, S), generator=g)  # [B, S]
    real = torch.arange(S)[None, :] < LENGTHS[:, None]  # [B, S]
    ids = ids.masked_fill(~real, 0)
    token_mask = real.float()
    token_mask[:, :3] = 0.0  # a "prompt" the loss must ignore
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=LENGTHS.clone(),
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 1]),
        advantages=torch.randn(B, 1, generator=g).expand(B, S).clone(),
    )


def rl_batch(policy: Policy, data: BatchedDataDict) -> BatchedDataDict:
    """Add the keys ClippedPGLossFn reads, from the policy itself (with a little off-policy noise)."""
    lp = policy.get_logprobs(data)["logprobs"]
    data = data.copy()
    data["prev_logprobs"] = lp
    data["generation_logprobs"] = lp + 0.01 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    return data


def direct_logits(model_dir: Path) -> tuple[torch.nn.Module, Any]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits(data: BatchedDataDict) -> torch.Tensor:
        mask = (torch.arange(S)[None, :] < data["input_lengths"][:, None]).long()
        with torch.no_grad():
            return model(input_ids=data["input_ids"], attention_mask=mask).logits.float()  # [B, S, V]

    return model, logits


def next_token_mask() -> torch.Tensor:
    return torch.arange(1, S)[None, :] < LENGTHS[:, None]  # [B, S-1] target token is real


def weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.state_dict_for_refit().items()}


@pytest.fixture(scope="module")
def vocab(char_tokenizer) -> int:
    return len(char_tokenizer)


# ---------------------------------------------------------------------------------------------- 1, 2, 5
@pytest.mark.parametrize("temperature,chunk", [(1.0, None), (0.7, 1), (1.3, 5)])
def test_logprobs_match_direct_forward(tiny_model_dir, char_tokenizer, vocab, temperature, chunk) -> None:
    cfg = make_config(tiny_model_dir, logprob_chunk_size=chunk, generation={"temperature": temperature})
    policy = Policy(cfg, char_tokenizer)
    data = make_batch(vocab)
    _, logits_of = direct_logits(tiny_model_dir)
    want = (logits_of(data)[:, :-1] / temperature).log_softmax(-1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    for key, out in (
        ("logprobs", policy.get_logprobs(data)),
        ("reference_logprobs", policy.get_reference_policy_logprobs(data, micro_batch_size=3)),
    ):
        got = out[key]
        assert got.shape == (B, S) and got.dtype == torch.float32 and got.device.type == "cpu"
        assert torch.all(got[:, 0] == 0)
        valid = next_token_mask()
        assert torch.all(got[:, 1:][~valid] == 0)  # padding
        assert (got[:, 1:] - want).masked_fill(~valid, 0).abs().max() <= 1e-5


def test_reference_stays_at_original_weights_after_training(tiny_model_dir, char_tokenizer, vocab) -> None:
    policy = Policy(make_config(tiny_model_dir), char_tokenizer)
    data = rl_batch(policy, make_batch(vocab))
    before = policy.get_logprobs(data)["logprobs"]
    assert torch.equal(before, policy.get_reference_policy_logprobs(data)["reference_logprobs"])
    policy.train(data, ClippedPGLossFn(ClippedPGLossConfig()))
    after = policy.get_logprobs(data)["logprobs"]
    ref = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert (after - before).abs().max() > 1e-3
    assert torch.equal(ref, before)


def test_topk_logits_match_torch_topk(tiny_model_dir, char_tokenizer, vocab) -> None:
    cfg = make_config(tiny_model_dir, generation={"temperature": 0.8}, logprob_batch_size=3)
    policy = Policy(cfg, char_tokenizer)
    data = make_batch(vocab)
    out = policy.get_topk_logits(data, k=4)
    vals, idx = out["topk_logits"], out["topk_indices"]
    assert vals.shape == idx.shape == (B, S - 1, 4) and vals.dtype == torch.float32 and idx.dtype == torch.int64
    _, logits_of = direct_logits(tiny_model_dir)
    want = (logits_of(data)[:, :-1] / 0.8).topk(4, dim=-1)
    valid = next_token_mask()
    assert (vals - want.values)[valid].abs().max() <= 1e-5
    assert torch.equal(idx[valid], want.indices[valid])
    assert torch.all(vals[~valid] == 0) and torch.all(idx[~valid] == 0)


def test_top_k_filtering_in_logprob_pass_but_not_reference(tiny_model_dir, char_tokenizer, vocab) -> None:
    policy = Policy(make_config(tiny_model_dir, generation={"top_k": 5}), char_tokenizer)
    data = make_batch(vocab)
    _, logits_of = direct_logits(tiny_model_dir)
    logits = logits_of(data)[:, :-1]  # [B, S-1, V]
    kth = logits.topk(5, dim=-1).values[..., -1:]
    filtered = logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1)
    want = filtered.gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    keep = (
        next_token_mask() & torch.isfinite(want) & (data["token_mask"][:, 1:] > 0) & (data["sample_mask"][:, None] > 0)
    )
    got = policy.get_logprobs(data)["logprobs"][:, 1:]
    assert (got - want).masked_fill(~keep, 0).abs().max() <= 1e-5
    assert torch.all(got[~keep] == 0) and torch.isfinite(got).all()
    unfiltered = logits.log_softmax(-1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    ref = policy.get_reference_policy_logprobs(data)["reference_logprobs"][:, 1:]
    assert (ref - unfiltered).masked_fill(~next_token_mask(), 0).abs().max() <= 1e-5

    seen: dict[str, Any] = {}

    def spy_loss(lp: torch.Tensor, mb: dict, n_seqs: torch.Tensor, n_toks: torch.Tensor):
        seen["unfiltered"] = mb.get("curr_logprobs_unfiltered")
        return NLLLossFn()(lp, mb, n_seqs, n_toks)

    res = policy.train(data, spy_loss, mbs=8)
    assert seen["unfiltered"] is not None and seen["unfiltered"].shape == (B, S - 1)
    assert torch.isfinite(res["loss"]).all() and torch.isfinite(res["grad_norm"])


# ---------------------------------------------------------------------------------------------- 3, 4
def test_gradient_accumulation_matches_full_batch(tiny_model_dir, char_tokenizer, vocab) -> None:
    # Adam's first step is ~lr * sign(grad), so summation-order noise on near-zero gradient entries moves a weight
    # by up to ~lr * 1e-3; lr=1e-4 keeps that far below the 1e-6 tolerance while every weight still moves ~1e-4.
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    cfg = make_config(tiny_model_dir, optimizer={"kwargs": {"lr": 1e-4}})
    results, finals = [], []
    for mbs in (2, 8):
        policy = Policy(cfg, char_tokenizer)
        start = weights(policy)
        data = rl_batch(policy, make_batch(vocab))
        results.append(policy.train(data, loss_fn, gbs=8, mbs=mbs))
        finals.append(weights(policy))
    acc, full = results
    assert acc["loss"].shape == (1,) and torch.allclose(acc["loss"], full["loss"], atol=1e-6)
    assert abs(float(acc["grad_norm"]) - float(full["grad_norm"])) <= 1e-5
    assert max(float((finals[0][k] - start[k]).abs().max()) for k in start) > 5e-5  # the step did something
    for name in finals[0]:
        assert (finals[0][name] - finals[1][name]).abs().max() <= 1e-6, name
    assert len(acc["all_mb_metrics"]["loss"]) == 4 and len(full["all_mb_metrics"]["loss"]) == 1
    batch = make_batch(vocab)
    assert acc["all_mb_metrics"]["global_valid_seqs"] == [7.0] * 4
    assert (
        acc["all_mb_metrics"]["global_valid_toks"]
        == [float((batch["token_mask"][:, 1:].sum(1) * batch["sample_mask"]).sum())] * 4
    )
    assert sum(acc["all_mb_metrics"]["loss"]) == pytest.approx(float(acc["loss"].sum()), abs=1e-6)


def test_multiple_global_batches_and_empty_micro_batches(tiny_model_dir, char_tokenizer, vocab) -> None:
    policy = Policy(make_config(tiny_model_dir), char_tokenizer)
    data = make_batch(vocab)
    data["sample_mask"] = torch.tensor([1.0, 1, 0, 0, 1, 1, 1, 1])  # micro-batch 2 (rows 2-3) has no valid sample
    version = policy.weights_version
    res = policy.train(data, NLLLossFn(), gbs=4, mbs=2)
    assert res["loss"].shape == (2,) and res["num_global_batches"] == 2
    assert len(res["all_mb_metrics"]["loss"]) == 3  # 4 micro-batches, the empty one dropped
    assert policy.weights_version == version + 2  # one optimizer step per global batch


def test_eval_mode_changes_nothing_and_matches_first_step_loss(tiny_model_dir, char_tokenizer, vocab) -> None:
    policy = Policy(make_config(tiny_model_dir, scheduler={"warmup_steps": 3}), char_tokenizer)
    data = rl_batch(policy, make_batch(vocab))
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    before = weights(policy)
    worker = policy.generation_source
    ev = policy.train(data, loss_fn, eval_mode=True)
    assert all(torch.equal(before[k], v) for k, v in weights(policy).items())
    assert worker.optimizer.state_dict()["state"] == {} and worker.scheduler.last_epoch == 0
    assert policy.weights_version == 0 and ev["grad_norm"] is None
    tr = policy.train(data, loss_fn)
    assert torch.equal(ev["loss"], tr["loss"])
    assert ev["lr"] == tr["lr"] == pytest.approx(1e-3)  # warm-up starts at 0.1 x lr
    assert any(not torch.equal(before[k], v) for k, v in weights(policy).items())


# ---------------------------------------------------------------------------------------------- 6
def test_calibrate_qkv_fp8_scales(tiny_model_dir, char_tokenizer, vocab) -> None:
    policy = Policy(make_config(tiny_model_dir), char_tokenizer)
    data = make_batch(vocab)

    def scales(**kw: Any) -> dict[str, float]:
        out = policy.calibrate_qkv_fp8_scales(data, micro_batch_size=1, **kw)
        assert out["format"] == "fp8"
        return out["layers"]

    kv = scales()
    assert set(kv) == {f"model.layers.{i}.self_attn.{t}_scale" for i in range(2) for t in "kv"}
    qkv = scales(include_q=True)
    assert set(qkv) == set(kv) | {f"model.layers.{i}.self_attn.attn.q_scale" for i in range(2)}
    assert all(v > 0 for v in qkv.values())
    by_p = [scales(percentile=p) for p in (0.0, 25.0, 50.0, 90.0, 100.0)]
    for key in kv:
        series = [s[key] for s in by_p]
        assert series == sorted(series) and series[-1] > series[0], key
    base, doubled = scales(margin=1.0), scales(margin=2.0)
    for key in kv:
        assert doubled[key] == pytest.approx(2 * base[key], rel=1e-12)
    assert scales(margin=1.05)[next(iter(kv))] == pytest.approx(1.05 * base[next(iter(kv))], rel=1e-12)


# ---------------------------------------------------------------------------------------------- 7
def test_checkpoint_round_trip_and_exact_resume(tiny_model_dir, char_tokenizer, vocab, tmp_path) -> None:
    cfg = make_config(tiny_model_dir, scheduler={"warmup_steps": 2, "name": "cosine", "decay_steps": 3})
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    batches = [make_batch(vocab, seed=s) for s in (0, 1)]
    a = Policy(cfg, char_tokenizer, max_num_steps=10)
    a.train(rl_batch(a, batches[0]), loss_fn)
    a.save_checkpoint(str(tmp_path / "w"), str(tmp_path / "opt"), str(tmp_path / "tok"))
    saved = weights(a)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "w", dtype=torch.float32)
    assert all(torch.equal(saved[k], v) for k, v in hf.state_dict().items())
    assert AutoTokenizer.from_pretrained(tmp_path / "tok")("1+2")["input_ids"] == char_tokenizer("1+2")["input_ids"]
    assert json.loads((tmp_path / "w" / "config.json").read_text())["model_type"] == "qwen2"

    step2 = rl_batch(a, batches[1])
    res_a = a.train(step2, loss_fn)
    b = Policy(
        cfg, char_tokenizer, weights_path=str(tmp_path / "w"), optimizer_path=str(tmp_path / "opt"), max_num_steps=10
    )
    assert b.weights_version == 1
    res_b = b.train(step2, loss_fn)
    assert res_a["lr"] == res_b["lr"] and torch.equal(res_a["loss"], res_b["loss"])
    assert all(torch.equal(v, weights(b)[k]) for k, v in weights(a).items())
    # load_checkpoint into a live policy: same weights, reference untouched (still the base model)
    c = Policy(cfg, char_tokenizer, max_num_steps=10)
    base_ref = c.get_reference_policy_logprobs(step2)["reference_logprobs"]
    live = c.generation_source.model
    c.load_checkpoint(str(tmp_path / "w"), str(tmp_path / "opt"))
    assert c.generation_source.model is live and all(torch.equal(saved[k], v) for k, v in weights(c).items())
    assert torch.equal(c.get_reference_policy_logprobs(step2)["reference_logprobs"], base_ref)
    assert torch.equal(c.train(step2, loss_fn)["loss"], res_a["loss"])


# ---------------------------------------------------------------------------------------------- 8
def test_bad_model_paths(tiny_model_dir, char_tokenizer, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Policy(make_config(tmp_path / "missing"), char_tokenizer)
    with pytest.raises(ValueError, match="no config.json"):
        Policy(make_config(tmp_path), char_tokenizer)
    (tmp_path / "config.json").write_text((Path(tiny_model_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match="cannot load a causal language model"):
        Policy(make_config(tmp_path), char_tokenizer)
    with pytest.raises(ValueError, match="hf_config_overrides.*num_hidden_layer'"):
        Policy(make_config(tiny_model_dir, hf_config_overrides={"num_hidden_layer": 1}), char_tokenizer)
    with pytest.raises(ValueError, match="cosine.*decay_steps"):
        Policy(make_config(tiny_model_dir, scheduler={"name": "cosine"}), char_tokenizer)


def test_bad_batches(tiny_model_dir, char_tokenizer, vocab) -> None:
    policy = Policy(make_config(tiny_model_dir), char_tokenizer, init_reference_model=False)
    good = make_batch(vocab)
    cases = [
        ({k: v for k, v in good.items() if k != "input_lengths"}, "input_lengths"),
        ({**good, "sample_mask": torch.ones(B - 1)}, "sample_mask=7"),
        ({**good, "input_lengths": LENGTHS + 1}, "input_lengths must lie in"),
        ({**good, "token_mask": torch.ones(B, S + 1)}, "token_mask has sequence length 13"),
        ({**good, "input_ids": good["input_ids"].float()}, "input_ids must be an integer tensor"),
    ]
    for batch, message in cases:
        with pytest.raises(ValueError, match=message):
            policy.get_logprobs(BatchedDataDict(batch))
    with pytest.raises(ValueError, match="missing required key.*token_mask"):
        policy.train(BatchedDataDict({k: v for k, v in good.items() if k != "token_mask"}), NLLLossFn())
    with pytest.raises(ValueError, match="not a positive multiple of the global batch size 16"):
        policy.train(good, NLLLossFn(), gbs=16)
    with pytest.raises(ValueError, match="micro-batches of 3"):
        policy.train(good, NLLLossFn(), mbs=3)
    with pytest.raises(RuntimeError, match="init_reference_model=False"):
        policy.get_reference_policy_logprobs(good)


# ---------------------------------------------------------------------------------------------- 9
def test_lr_schedule_formula() -> None:
    warm = SchedulerConfig(warmup_steps=4, warmup_start_factor=0.2)
    assert [lr_factor(s, warm, None) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    cos = SchedulerConfig(name="cosine", warmup_steps=2, warmup_start_factor=0.5, decay_steps=4, min_lr_ratio=0.1)
    want = [0.5, 0.75] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(5)] + [0.1, 0.1]
    assert [lr_factor(s, cos, None) for s in range(9)] == pytest.approx(want)
    # decay_steps=None falls back to max_num_steps
    assert lr_factor(4, SchedulerConfig(name="cosine"), max_num_steps=8) == pytest.approx(0.5)


def test_lr_schedule_steps_once_per_train_call(tiny_model_dir, char_tokenizer, vocab) -> None:
    sched = {"name": "cosine", "warmup_steps": 2, "warmup_start_factor": 0.1, "min_lr_ratio": 0.2}
    policy = Policy(make_config(tiny_model_dir, scheduler=sched), char_tokenizer, max_num_steps=3)
    data = make_batch(vocab)
    lrs = [policy.train(data, NLLLossFn(), gbs=4, mbs=4)["lr"] for _ in range(5)]  # 2 optimizer steps per call
    cosine = [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * t / 3)) for t in range(3)]
    assert lrs == pytest.approx([1e-2 * f for f in [0.1, 0.55] + cosine])
    assert policy.weights_version == 10


# ---------------------------------------------------------------------------------------------- executor
def test_two_data_parallel_workers_match_one(tiny_model_dir, char_tokenizer, vocab) -> None:
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    outs = []
    for workers in (1, 2):
        policy = Policy(make_config(tiny_model_dir), char_tokenizer, cluster=ClusterConfig(workers_per_node=workers))
        data = rl_batch(policy, make_batch(vocab))
        res = policy.train(data, loss_fn, gbs=4, mbs=2)
        outs.append((data, res, weights(policy), policy.get_logprobs(data)["logprobs"]))
    (d1, r1, w1, lp1), (d2, r2, w2, lp2) = outs
    assert torch.equal(d1["prev_logprobs"], d2["prev_logprobs"])  # sharded logprobs come back in input order
    assert torch.allclose(r1["loss"], r2["loss"], atol=1e-6)
    # metrics are divided by the number of global batches: their sum over ranks and micro-batches is the mean loss
    assert sum(r2["all_mb_metrics"]["loss"]) == pytest.approx(float(r1["loss"].mean()), abs=1e-6)
    assert all((w1[k] - w2[k]).abs().max() <= 1e-6 for k in w1)
    assert (lp1 - lp2).abs().max() <= 1e-5


def test_deterministic_mode_is_bitwise_reproducible(tiny_model_dir, char_tokenizer, vocab) -> None:
    was = torch.are_deterministic_algorithms_enabled()
    try:
        runs = []
        for _ in range(2):
            policy = Policy(make_config(tiny_model_dir), char_tokenizer, cluster=ClusterConfig(deterministic=True))
            data = rl_batch(policy, make_batch(vocab))
            res = policy.train(data, ClippedPGLossFn(ClippedPGLossConfig()))
            runs.append((res["loss"], weights(policy), policy.get_logprobs(data)["logprobs"]))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][2], runs[1][2])
        assert all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items())
    finally:
        torch.use_deterministic_algorithms(was)


def test_colocation_surface_and_phases(tiny_model_dir, char_tokenizer, vocab, tmp_path) -> None:
    policy = Policy(make_config(tiny_model_dir), char_tokenizer, init_reference_model=False)
    source = policy.generation_source
    assert isinstance(source.model, torch.nn.Module) and source.weights_version == 0
    live = policy.state_dict_for_refit()
    name = "model.embed_tokens.weight"
    assert live[name].data_ptr() == source.model.get_input_embeddings().weight.data_ptr()  # no copy
    info = policy.prepare_refit_info()
    assert info is not None and info[name] == (tuple(live[name].shape), torch.float32) and set(info) == set(live)
    policy.prepare_for_lp_inference()
    assert not source.model.training
    policy.prepare_for_training()
    assert source.model.training
    policy.train(make_batch(vocab), NLLLossFn())
    policy.finish_training()
    policy.offload_before_refit()
    policy.offload_after_refit()
    assert source.weights_version == policy.weights_version == 1 and policy.device.type in ("cpu", "cuda")
    (joined,) = policy.init_collective("127.0.0.1", 1, 2, train_world_size=2)  # no generation rank left
    with pytest.raises(ValueError, match="train_world_size=2 < world_size=2"):
        joined.result(timeout=60)
    (streamed,) = policy.stream_weights_via_ipc_zmq(1 << 20, kv_scales={"k_scale": 1.0})
    with pytest.raises(ValueError, match="kv_scales must be None"):
        streamed.result(timeout=60)
    (sent,) = policy.broadcast_weights_for_collective()
    with pytest.raises(RuntimeError, match="call init_collective first"):
        sent.result(timeout=60)
    assert policy.shutdown() is True and policy.shutdown() is True


def test_bfloat16_autocast_keeps_float32_master_weights(tiny_model_dir, char_tokenizer, vocab) -> None:
    data = make_batch(vocab)
    fp32 = Policy(make_config(tiny_model_dir), char_tokenizer, init_reference_model=False)
    bf16 = Policy(make_config(tiny_model_dir, precision="bfloat16"), char_tokenizer, init_reference_model=False)
    lp32, lp16 = fp32.get_logprobs(data)["logprobs"], bf16.get_logprobs(data)["logprobs"]
    assert lp16.dtype == torch.float32 and 0 < (lp32 - lp16).abs().max() < 0.1
    res = bf16.train(data, NLLLossFn(), mbs=4)
    assert torch.isfinite(res["loss"]).all() and res["model_dtype"] == "torch.bfloat16"
    assert all(v.dtype == torch.float32 for v in bf16.state_dict_for_refit().values())
    assert bf16.prepare_refit_info()["model.norm.weight"][1] == torch.bfloat16  # streamed in the compute precision


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_weights_a_ray_driver_receives_are_host_tensors(tiny_model_dir, char_tokenizer, device) -> None:
    """Async GRPO on Ray sends rank 0's weights to the driver's producer: in host memory, so that a driver without a
    GPU can read them and one with a GPU opens no context. On the CPU nothing is copied (sending copies them)."""
    policy = Policy(make_config(tiny_model_dir), char_tokenizer, cluster=ClusterConfig(device=device))
    try:
        live, host = policy.state_dict(), policy.host_state_dict()
        assert list(host) == list(live) and {t.device.type for t in live.values()} == {device}
        assert all(t.device.type == "cpu" and torch.equal(t, live[k].cpu()) for k, t in host.items())
        shares = [t.data_ptr() == live[k].data_ptr() for k, t in host.items()]
        assert all(shares) if device == "cpu" else not any(shares)
    finally:
        policy.shutdown()

"""`policy.precision`: bfloat16 computes under autocast over float32 master weights and optimizer state; float16
adds dynamic loss scaling (an overflow skips the step and lowers the scale)."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.loss_functions import ClippedPGLossFn, NLLLossFn
from relayrl.config import ClippedPGLossConfig, PolicyConfig
from relayrl.models.policy.lm_policy import Policy
from tests.unit.models.policy.test_lm_policy import make_batch, make_config, next_token_mask, rl_batch, weights


@pytest.fixture(scope="module")
def vocab(char_tokenizer) -> int:
    return len(char_tokenizer)


@pytest.fixture(scope="module")
def fp32_run(tiny_model_dir, char_tokenizer, vocab) -> dict:
    policy = Policy(make_config(tiny_model_dir), char_tokenizer)
    data = rl_batch(policy, make_batch(vocab))
    result = policy.train(data, ClippedPGLossFn(ClippedPGLossConfig()), gbs=8, mbs=2)
    return {"data": data, "result": result}


def test_bf16_step_keeps_float32_master_weights_and_adam_state(tiny_model_dir, char_tokenizer, vocab, fp32_run) -> None:
    policy = Policy(make_config(tiny_model_dir, precision="bfloat16"), char_tokenizer)
    start = weights(policy)
    data = fp32_run["data"]
    lp16 = policy.get_logprobs(data)["logprobs"][:, 1:][next_token_mask()]
    lp32 = data["prev_logprobs"][:, 1:][next_token_mask()]
    err = (lp16 - lp32).abs()
    assert 0 < float(err.max()) < 0.1  # bf16 products, not bitwise float32, but close
    result = policy.train(data, ClippedPGLossFn(ClippedPGLossConfig()), gbs=8, mbs=2)
    assert result["model_dtype"] == "torch.bfloat16"
    assert torch.isfinite(result["loss"]).all() and float(result["grad_norm"]) > 0
    assert float(result["loss"].sum()) == pytest.approx(float(fp32_run["result"]["loss"].sum()), abs=0.02)
    worker = policy.generation_source
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())
    state = [t for s in worker.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert state and all(t.dtype == torch.float32 for t in state)  # Adam moments in float32
    after = weights(policy)
    assert max(float((after[k] - start[k]).abs().max()) for k in start) > 1e-3  # the step moved the weights
    assert worker.grad_scaler is None  # bf16 has float32's exponent range: no loss scaling


def test_fp16_trains_with_a_loss_scaler_and_skips_an_overflow(tiny_model_dir, char_tokenizer, vocab) -> None:
    policy = Policy(make_config(tiny_model_dir, precision="float16"), char_tokenizer)
    worker = policy.generation_source
    scaler = worker.grad_scaler
    assert scaler is not None and scaler.is_enabled()
    data = make_batch(vocab)
    start = weights(policy)
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**100})  # no float16 gradient survives this scale
    result = policy.train(data, NLLLossFn(), gbs=8, mbs=8)
    assert float(result["grad_norm"]) == 0.0 and scaler.get_scale() == 2.0**99  # skipped, scale backed off
    assert all(torch.equal(start[k], v) for k, v in weights(policy).items())  # no weight moved
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**8})
    result = policy.train(data, NLLLossFn(), gbs=8, mbs=8)
    assert float(result["grad_norm"]) > 0 and scaler.get_scale() == 2.0**8
    after = weights(policy)
    assert max(float((after[k] - start[k]).abs().max()) for k in start) > 1e-3
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())


def test_fp16_is_refused_with_fsdp2_in_one_line() -> None:
    with pytest.raises(ValueError, match="policy.precision=float16 does not support"):
        PolicyConfig(precision="float16", data_parallel={"strategy": "fsdp2"})


@pytest.mark.parametrize("enabled", [False, True])
def test_empty_cache_only_behind_its_setting(tiny_model_dir, char_tokenizer, vocab, monkeypatch, enabled) -> None:
    """No `torch.cuda.empty_cache()` inside a step unless `policy.empty_cache_between_phases` (an accelerator is
    faked: the calls are counted, not made)."""
    from relayrl.utils import device as dev

    policy = Policy(make_config(tiny_model_dir, empty_cache_between_phases=enabled), char_tokenizer)
    calls = []
    monkeypatch.setattr(dev, "is_accelerator", lambda device: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    data = make_batch(vocab)
    policy.prepare_for_lp_inference()
    policy.get_reference_policy_logprobs(data)
    policy.prepare_for_training()
    policy.offload_after_refit()
    assert (len(calls) > 0) == enabled


@pytest.mark.parametrize("offload", [False, True])
def test_bf16_reference_stores_bf16_projections_with_the_same_values(
    tiny_model_dir, char_tokenizer, vocab, offload
) -> None:
    """The reference keeps its projections in the compute precision (what autocast rounds them to anyway): its
    log-probs equal the float32 policy's under autocast bit for bit, at half the memory."""
    cfg = make_config(tiny_model_dir, precision="bfloat16", reference={"offload": offload})
    policy = Policy(cfg, char_tokenizer)
    ref = policy.generation_source.reference_model
    linears = [m for m in ref.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert ref.get_input_embeddings().weight.dtype == torch.float32  # the lookup stays float32 (head untied)
    data = make_batch(vocab)
    ref_lp = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    live_lp = policy.get_logprobs(data)["logprobs"]  # float32 master weights under autocast, before any step
    assert torch.equal(ref_lp, live_lp)
    assert next(ref.parameters()).device.type == "cpu"

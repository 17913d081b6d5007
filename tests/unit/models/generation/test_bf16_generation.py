"""Generation in `policy.precision=bfloat16`: a bf16 copy of the projections refreshed with the weights, a bf16 KV
cache, the compiled CPU step in bf16, and log-probs close to the training forward's (autocast) ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from relayrl.config import ColocatedConfig, GenerationConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.fast.compute_weights import ComputeWeights
from relayrl.models.fast.decoder import FastDecoder
from relayrl.models.fast.forward import backbone_hidden_states
from relayrl.models.fast.kernels import load_cpu_kernels
from relayrl.models.generation.hf_generation import HfGeneration
from tests.helpers import build_test_model

PROMPTS = ["12+34=", "7-3=", "hello world!", "ab", "99-1=", "x"]


class Source:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights_version = 0


@pytest.fixture(scope="module")
def model(char_tokenizer) -> torch.nn.Module:
    m = build_test_model(char_tokenizer).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # larger weights: varied continuations, log-probs far from uniform
        for name, p in m.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / math.sqrt(p.shape[1]))
    return m


def _batch(tokenizer) -> BatchedDataDict:
    encoded = [tokenizer(p)["input_ids"] for p in PROMPTS]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in encoded]))


def _engine(tokenizer, model, precision: str = "bfloat16", colocated: bool = True, **cfg) -> HfGeneration:
    config = GenerationConfig(max_new_tokens=10, colocated=ColocatedConfig(enabled=colocated), **cfg)
    return HfGeneration(config, tokenizer, Source(model), precision=precision, seed=0)


def _head_copy(engine: HfGeneration, model: torch.nn.Module) -> torch.Tensor:
    weights = engine.compute_weights
    assert weights is not None
    return weights(model.model.layers[0].mlp.up_proj.weight)


def test_compute_weights_copy_projections_once_each_in_bf16(model) -> None:
    weights = ComputeWeights(torch.bfloat16)
    assert weights.refresh(model, key=1)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        copy = weights(m.weight)
        assert copy.dtype == torch.bfloat16 and torch.equal(copy, m.weight.detach().bfloat16())
        assert copy.data_ptr() != m.weight.data_ptr()  # a copy: the float32 master is untouched
        assert m.weight.dtype == torch.float32
    # tied LM head and embedding: one copy
    assert len(weights.copies()) == len({id(t) for m in linears for t in (m.weight, m.bias) if t is not None})
    assert not weights.refresh(model, key=1)  # same key: nothing copied
    with pytest.raises(KeyError):
        weights(model.model.norm.weight)  # norms stay float32, not copied
    with pytest.raises(ValueError, match="low-precision"):
        ComputeWeights(torch.float32)


def test_bf16_engine_decodes_from_a_copy_refreshed_after_each_weight_update(char_tokenizer, model) -> None:
    live = build_test_model(char_tokenizer).eval()
    live.load_state_dict(model.state_dict())
    engine = _engine(char_tokenizer, live)
    batch = _batch(char_tokenizer)
    engine.prepare_for_generation()
    first = engine.generate(batch, seed=1)
    up = live.model.layers[0].mlp.up_proj.weight
    before = _head_copy(engine, live).clone()
    assert torch.equal(before, up.detach().bfloat16())
    with torch.no_grad():
        up.mul_(-1.5)  # an optimizer step changes the live weights ...
    engine._source.weights_version += 1  # ... and bumps the version
    engine.prepare_for_generation()
    second = engine.generate(batch, seed=1)
    after = _head_copy(engine, live)
    assert torch.equal(after, up.detach().bfloat16()) and not torch.equal(after, before)
    assert engine.compute_weights is not None and engine.compute_weights.refreshes == 2
    assert not torch.equal(first["logprobs"], second["logprobs"])  # it decodes from the refreshed copy
    engine.generate(batch, seed=1)
    assert engine.compute_weights.refreshes == 2  # same weights version: no new copy


def test_bf16_private_engine_refits_its_copy_on_load_weights(char_tokenizer, model) -> None:
    engine = _engine(char_tokenizer, model, colocated=False)
    batch = _batch(char_tokenizer)
    engine.generate(batch, seed=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.0.mlp.up_proj.weight"] *= 2.0
    engine.load_weights(state, version=0)  # a refit may keep the version number: the copy still follows
    engine.generate(batch, seed=1)
    up = engine.model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(_head_copy(engine, engine.model), up.detach().bfloat16())
    assert torch.equal(up, state["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("native", [False, True])
def test_bf16_decoder_keeps_a_bf16_cache_and_agrees_with_float32(char_tokenizer, model, native: bool) -> None:
    if native and not load_cpu_kernels():
        pytest.skip("compiled CPU kernels unavailable")
    batch = _batch(char_tokenizer)
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    cols = int(lengths.max())
    shift = (cols - lengths).unsqueeze(1)
    src = torch.arange(cols).unsqueeze(0) - shift
    valid = src >= 0
    left = ids.gather(1, src.clamp(min=0)).masked_fill(~valid, 0)
    weights = ComputeWeights(torch.bfloat16)
    weights.refresh(model, key=0)
    logits = {}
    with torch.inference_mode():
        for name, compute in (("f32", None), ("bf16", weights)):
            dec = FastDecoder(model, native=native, compute=compute)
            assert dec.native == native
            out = [dec.start(left, valid, src.clamp(min=0), cols + 4)]
            tok = out[0].float().argmax(-1)
            for s in range(3):
                out.append(dec.step(tok, lengths + s, cols + s))
            logits[name] = torch.stack([o.float() for o in out])  # [4, B, V]
            if compute is not None:
                assert dec.k_cache[0].dtype == torch.bfloat16 and dec.v_cache[0].dtype == torch.bfloat16
                assert out[-1].dtype == torch.bfloat16
    lp32, lp16 = logits["f32"].log_softmax(-1), logits["bf16"].log_softmax(-1)
    err = (lp16 - lp32).abs()
    assert 0 < float(err.max()) < 0.25  # bf16 rounds (not bitwise float32) but stays close
    assert float(err.mean()) < 0.03


def test_bf16_native_step_matches_bf16_pytorch_ops(char_tokenizer, model) -> None:
    if not load_cpu_kernels():
        pytest.skip("compiled CPU kernels unavailable")
    batch = _batch(char_tokenizer)
    outs = {}
    for native in (False, True):
        engine = _engine(char_tokenizer, model, native_cpu_decode=native, temperature=1.0)
        outs[native] = engine.generate(batch, greedy=True)
    # Same bf16 products and cache; only the attention arithmetic differs (float32 loops vs bf16 SDPA).
    torch.testing.assert_close(outs[True]["logprobs"], outs[False]["logprobs"], atol=0.05, rtol=0)


def test_bf16_generation_logprobs_close_to_training_forward(char_tokenizer, model) -> None:
    """The generation-vs-training mismatch the loss logs as `token_mult_prob_error` (mean exp|gen - train|)."""
    batch = _batch(char_tokenizer)
    errors = {}
    for precision in ("float32", "bfloat16"):
        out = _engine(char_tokenizer, model, precision=precision).generate(batch, seed=5)
        ids, n = out["output_ids"], out["unpadded_sequence_lengths"]
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bfloat16"):
            hidden = backbone_hidden_states(model, ids, n)  # [B, S, H]: the training passes' forward
            logits = model.lm_head(hidden).float()
        train = F.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)  # [B, S-1]
        gen_mask = out["logprobs"][:, 1:] != 0
        gen = out["logprobs"][:, 1:][gen_mask]
        errors[precision] = float(torch.exp((gen - train[gen_mask]).abs()).mean())
    assert errors["float32"] < 1.0 + 1e-4
    assert 1.0 < errors["bfloat16"] < 1.02

"""relayrl's compiled CPU kernels (csrc/cpu_kernels.cpp) against the PyTorch formulations they replace."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from relayrl.config import GenerationConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.fast import kernels
from relayrl.models.fast.decoder import FastDecoder
from relayrl.models.fast.forward import selected_hidden_states
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.tiny import build_tiny_qwen2

# Skipped only where there is no toolchain to build with; with one, a library that fails to build fails the tests.
HAVE_TOOLCHAIN = (
    shutil.which(os.environ.get("CXX", "c++")) is not None and importlib.util.find_spec("ninja") is not None
)
pytestmark = pytest.mark.skipif(not HAVE_TOOLCHAIN, reason="no C++ compiler / ninja: relayrl's CPU kernels not built")


def test_the_kernel_library_builds_and_loads_here() -> None:
    assert kernels.load_cpu_kernels()


def _sharp(model: torch.nn.Module) -> torch.nn.Module:
    """Large random weights and biases, so logits spread widely and every bias term matters."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            scale = 1.0 if p.dim() == 1 else 2.0 / p.shape[1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def _llama(attention_bias: bool, mlp_bias: bool, kv_heads: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=80,
        max_position_embeddings=128,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        rms_norm_eps=1e-5,
    )
    return _sharp(LlamaForCausalLM(config))


MODELS = {
    "qwen2-gqa": lambda: _sharp(
        build_tiny_qwen2(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    ),
    "llama-mha-no-bias": lambda: _llama(False, False, 4),
    "llama-mqa-all-biases": lambda: _llama(True, True, 1),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_native_step_matches_pytorch_step(name: str) -> None:
    """Prefill with left padding, 12 decode steps, a compaction that drops and reorders rows, 8 more steps: the
    logits and the KV caches of the compiled step equal the PyTorch step's to float32 rounding."""
    model = MODELS[name]()
    batch, prompt = 5, 9
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        ids = torch.randint(1, 50, (batch, prompt), generator=gen)
        valid = torch.ones(batch, prompt, dtype=torch.bool)
        valid[1, :4] = valid[3, :2] = False  # left padding: these keys must get -inf
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        ref, native = FastDecoder(model), FastDecoder(model, native=True)
        assert native.native and not ref.native
        logits = [d.start(ids, valid, positions, prompt + 24) for d in (ref, native)]
        torch.testing.assert_close(logits[1], logits[0])
        tokens, pos = logits[0].argmax(-1), positions[:, -1] + 1
        for step in range(20):
            if step == 12:
                keep = torch.tensor([4, 0, 3])
                ref.select(keep)
                native.select(keep)
                tokens, pos = tokens[keep], pos[keep]
            a, b = ref.step(tokens, pos, prompt + step), native.step(tokens, pos, prompt + step)
            # float32 rounding of differently ordered sums, relative to the logits' scale (a wrong term is O(1))
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
            tokens, pos = a.argmax(-1), pos + 1
        for caches in ((ref.k_cache, native.k_cache), (ref.v_cache, native.v_cache)):
            for x, y in zip(*caches):
                torch.testing.assert_close(y[:, :, : prompt + 20], x[:, :, : prompt + 20], rtol=1e-5, atol=1e-5)


class _Source:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights_version = 0


def test_sampled_generation_is_the_same_with_and_without_the_compiled_step(char_tokenizer) -> None:
    """Same seed: the same tokens (stop tokens, finished rows compacted away) and the same log-probs."""
    model = _sharp(build_tiny_qwen2(vocab_size=len(char_tokenizer), hidden_size=64, num_layers=2, seed=0))
    prompts = ["12+34=", "7-3=", "hello", "ab", "99-1=", "x"] * 2
    encoded = [char_tokenizer(p)["input_ids"] for p in prompts]
    ids = torch.full((len(encoded), 8), char_tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in encoded]))
    stops = [char_tokenizer.convert_tokens_to_ids(c) for c in "05"]  # frequent enough to end rows early
    outs = []
    for native in (False, True):
        cfg = GenerationConfig(max_new_tokens=24, stop_token_ids=stops, native_cpu_decode=native)
        engine = HfGeneration(cfg, char_tokenizer, _Source(model), seed=7)
        engine.prepare_for_generation()
        outs.append(engine.generate(data))
    assert bool((outs[0]["generation_lengths"] < 24).any())  # some rows stopped early
    assert torch.equal(outs[0]["output_ids"], outs[1]["output_ids"])
    torch.testing.assert_close(outs[1]["logprobs"], outs[0]["logprobs"], rtol=1e-5, atol=1e-5)


def test_models_outside_the_compiled_step_use_pytorch_ops() -> None:
    """q/k norms (qwen3) and non-float32 weights are not covered: the decoder keeps the PyTorch step."""
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=48,
        )
    )
    assert not FastDecoder(qwen3, native=True).native
    assert not FastDecoder(_llama(False, False, 2).to(torch.bfloat16), native=True).native
    assert FastDecoder(_llama(False, False, 2), native=True).native


def test_switched_off_or_unbuildable_falls_back_with_one_line_warning(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("RELAYRL_CPU_KERNELS", "0")
    assert kernels.build_and_load() is False
    monkeypatch.setenv("RELAYRL_CPU_KERNELS", "1")
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this source does not compile\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    monkeypatch.setenv("RELAYRL_KERNEL_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.build_and_load() is False
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "using PyTorch ops" in messages[0] and "\n" not in messages[0]


def test_native_sampler_draws_the_same_tokens_as_the_pytorch_sampler() -> None:
    """Inverse-CDF draws over 4096 rows (peaked and flat distributions, zero-probability tokens, uniforms at 0 and
    just below 1): the compiled sampler picks exactly the tokens of sampling.sample_inverse_cdf."""
    from relayrl.models.generation.sampling import TokenSampler

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4096, 103, generator=gen) * torch.tensor([0.1, 1.0, 8.0, 30.0]).repeat(1024)[:, None]
    logits[::7, 5:40] = float("-inf")  # zero-probability tokens a draw must never land on
    u = torch.rand(4096, generator=gen)
    u[:8], u[8:16] = 0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    python = TokenSampler(temperature=0.7, generator=torch.Generator(), native=False)
    native = TokenSampler(temperature=0.7, generator=torch.Generator(), native=True)
    assert native.native and not python.native
    (t0, lp0), (t1, lp1) = python(logits, u), native(logits, u)
    assert torch.equal(t0, t1)
    assert not bool(((t1[::7] >= 5) & (t1[::7] < 40)).any())
    torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=1e-6)
    assert not TokenSampler(top_p=0.9, generator=torch.Generator(), native=True).native  # filtering: PyTorch ops


@pytest.mark.parametrize("shape", [(37, 64), (11, 3, 24)])
def test_native_rms_norm_forward_and_backward_match_pytorch(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=gen) * torch.rand(shape[0], *[1] * (len(shape) - 1), generator=gen) * 3
    w0 = torch.randn(shape[-1], generator=gen)
    grad = torch.randn(shape, generator=gen)
    assert kernels.load_cpu_kernels()
    outs = []
    for native in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = kernels.rms_norm(x, w, 1e-6, native)
        y.backward(grad)
        outs.append((y.detach(), x.grad, w.grad))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_native_rope_forward_and_backward_match_pytorch() -> None:
    gen = torch.Generator().manual_seed(0)
    n, heads, d = 29, 3, 16
    x0 = torch.randn(n, heads, d, generator=gen)
    angles = torch.rand(n, 1, d // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)  # [N, 1, D]
    sin = torch.cat([-angles.sin(), angles.sin()], -1)  # rotate_half's sign folded in, as FastDecoder builds it
    grad = torch.randn(n, heads, d, generator=gen)
    assert kernels.load_cpu_kernels()
    outs = []
    for native in (False, True):
        x = x0.clone().requires_grad_()
        y = kernels.rope(x, cos, sin, native)
        y.backward(grad)
        outs.append((y.detach(), x.grad))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_policy_pass_with_native_ops_matches_pytorch_ops() -> None:
    """A training-style pass (selected positions, shared prefixes, backward into every parameter): hidden states and
    parameter gradients with the compiled RMSNorm/RoPE equal those of the PyTorch ops to float32 rounding."""
    model = _llama(True, False, 2).train()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 50, (6, 14), generator=gen)
    ids[1::2, :5] = ids[0::2, :5]  # shared prompt prefixes
    lengths = torch.tensor([14, 12, 9, 14, 5, 11])
    select = torch.rand(6, 14, generator=gen) < 0.6
    results = []
    for native in (False, True):
        model.zero_grad()
        hidden = selected_hidden_states(model, ids, lengths, select, native=native)
        (hidden.square().mean() + hidden.sum()).backward()
        results.append(
            (hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    assert results[0][1].keys() == results[1][1].keys() and len(results[0][1]) > 10
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=name)

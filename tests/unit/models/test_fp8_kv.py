"""FP8 KV-cache scales end to end (issue 15 part 4): calibration of the attention inputs, the scales' names and
layout, their trip with the refit, and generation with a float8 e4m3 cache.

Calibration is checked against a hand computation: the test rebuilds every layer's post-RoPE (and, for qwen3,
post-q/k-norm) q, k, v from the layer's input hidden states with plain torch ops, takes max |.| over each
micro-batch's real tokens, the nearest-rank percentile over micro-batches and amax * margin / 448.

Log-prob bound of the FP8 cache (see `test_fp8_cache_logprobs_within_bound`): e4m3 keeps 3 mantissa bits, so each
cached value x is off by at most |x| / 16 (below 2^-6 * scale, e4m3's subnormal range, by at most 2^-10 * scale).
That error reaches the log-probs through the attention scores and weighted sums, where it partly averages out over
keys; no useful closed-form bound follows, so it is measured. On the 2-layer test model (TEST_MODEL: hidden 64,
4 heads, 2 KV heads) with calibrated scales, teacher-forcing 8 rows of 40 tokens (a 6-token prompt, 33 steps):

    max |log p_fp8 - log p_fp32| over every position and vocabulary entry   0.0113
    mean of it over the fed tokens                                           0.0016

(the PyTorch fast decoder and the HF-forward decoder give the same figures to 1e-6); HfGeneration sampling 137
tokens, against the policy's own log-probs of them (what training compares with): max 0.0070, mean 0.0019 (the
float32 cache: 5e-7). The bounds, `MAX_LOGPROB_ERROR` = 0.03 and `MEAN_LOGPROB_ERROR` = 0.004, are about 2.5x the
measurements: room for another CPU's rounding, while scales 10x too small (most values saturated at +-448) give
0.36 and fail. Scales 1000x too large (most values subnormal) still give 0.013 here: the largest values, which
keep their precision, dominate. For comparison, the shipped trained model (`builtin:tiny-arith`, sharper logits) on
random tokens: max 0.57 over all entries (rare tokens), 0.19 over the fed tokens, mean 0.011.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig, GenerationConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models import fp8_kv
from relayrl.models.fast.decoder import FastDecoder, HfDecoder
from relayrl.models.generation.distributed import DistributedGeneration
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.policy.lm_policy import Policy
from tests.helpers import small_policy_config, train_on_policy

MAX_LOGPROB_ERROR = 0.03
MEAN_LOGPROB_ERROR = 0.004
LENGTHS = [9, 4, 7, 2, 9, 5]


@pytest.fixture(scope="module")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory, char_tokenizer: Any) -> Path:
    """A random 2-layer Qwen3 (q/k norms with non-unit weights, so they matter) saved as an HF directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(char_tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        pad_token_id=char_tokenizer.pad_token_id,
        eos_token_id=char_tokenizer.eos_token_id,
    )
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 3.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 3.0)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path


def ragged_rows(vocab: int, lengths: list[int] = LENGTHS, seed: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), width), generator=g)  # [B, S]
    real = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    return BatchedDataDict(input_ids=ids.masked_fill(~real, 0), input_lengths=torch.tensor(lengths))


# ---------------------------------------------------------------------------------------------- hand computation
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [b, S, heads, D] rotated as HF's default RoPE (halves rotated against each other), positions 0..S-1."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
    angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv_freq[None]  # [S, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None]  # [1, S, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def _linear(x: torch.Tensor, proj: Any) -> torch.Tensor:
    return x @ proj.weight.T + (0.0 if proj.bias is None else proj.bias)


@torch.no_grad()
def hand_attention_inputs(model: Any, ids: torch.Tensor, lengths: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer, 'q'|'k'|'v'): [b, S, heads, D]} after q/k norms and RoPE, from each layer's input hidden states."""
    cfg = model.config
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    out = model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True, use_cache=False
    )
    hidden = out.hidden_states  # [layers + 1] x [b, S, H]: hidden[i] enters layer i
    theta = float(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    result = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = _rms(hidden[i], layer.input_layernorm.weight, cfg.rms_norm_eps)
        b, s, _ = x.shape
        q, k, v = (_linear(x, proj).view(b, s, -1, head_dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):
            q, k = _rms(q, attn.q_norm.weight, cfg.rms_norm_eps), _rms(k, attn.k_norm.weight, cfg.rms_norm_eps)
        result[(i, "q")], result[(i, "k")], result[(i, "v")] = _rope(q, theta), _rope(k, theta), v
    return result


def hand_scales(
    model: Any, data: BatchedDataDict, micro_batch: int, percentile: float, margin: float
) -> dict[str, float]:
    samples: dict[tuple[int, str], list[float]] = {}
    for a in range(0, len(data["input_ids"]), micro_batch):
        ids, lengths = data["input_ids"][a : a + micro_batch], data["input_lengths"][a : a + micro_batch]
        real = torch.arange(ids.shape[1])[None] < lengths[:, None]  # [b, S]
        for key, t in hand_attention_inputs(model, ids, lengths).items():
            samples.setdefault(key, []).append(float(t.abs()[real].max()))
    out = {}
    for (layer, which), values in samples.items():
        ordered = sorted(values)
        amax = ordered[min(max(round(percentile / 100 * (len(ordered) - 1)), 0), len(ordered) - 1)]
        name = (
            f"model.layers.{layer}.self_attn.attn.q_scale"
            if which == "q"
            else f"model.layers.{layer}.self_attn.{which}_scale"
        )
        out[name] = amax * margin / 448.0
    return out


# ---------------------------------------------------------------------------------------------- calibration
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_calibration_matches_hand_computed_attention_inputs(arch, tiny_model_dir, qwen3_model_dir, char_tokenizer):
    policy = Policy(
        small_policy_config(tiny_model_dir if arch == "qwen2" else qwen3_model_dir),
        char_tokenizer,
        init_reference_model=False,
    )
    try:
        model = policy.generation_source.model
        data = ragged_rows(len(char_tokenizer))
        before = policy.get_logprobs(data)["logprobs"]
        impl = model.config._attn_implementation
        settings = ((99.9, 1.05), (50.0, 1.0), (0.0, 2.0))
        outs = [
            policy.calibrate_qkv_fp8_scales(data, micro_batch_size=2, percentile=p, margin=m, include_q=True)
            for p, m in settings
        ]
        assert model.config._attn_implementation == impl  # the observer is gone
        assert torch.equal(policy.get_logprobs(data)["logprobs"], before)
        for (percentile, margin), out in zip(settings, outs):
            assert out.keys() == {"format", "percentile", "margin", "layers"}
            assert (out["format"], out["percentile"], out["margin"]) == ("fp8", percentile, margin)
            expected = hand_scales(model, data, 2, percentile, margin)
            assert out["layers"].keys() == expected.keys()
            for name, value in expected.items():
                assert out["layers"][name] == pytest.approx(value, rel=1e-5), name
        # Not the projections: the pre-RoPE / pre-norm k of layer 0 has another maximum.
        ids, lengths = data["input_ids"][:2], data["input_lengths"][:2]
        with torch.no_grad():
            hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states[0]
            attn = model.model.layers[0].self_attn
            raw_k = attn.k_proj(model.model.layers[0].input_layernorm(hidden))
        real = torch.arange(ids.shape[1])[None] < lengths[:, None]
        post = hand_attention_inputs(model, ids, lengths)[(0, "k")].abs()[real].max()
        assert float(raw_k.abs()[real].max()) != pytest.approx(float(post), rel=1e-3)
    finally:
        policy.shutdown()


def test_scale_names_layout_and_fp8_max_override(tiny_model_dir, char_tokenizer, monkeypatch):
    policy = Policy(small_policy_config(tiny_model_dir), char_tokenizer, init_reference_model=False)
    try:
        data = ragged_rows(len(char_tokenizer))
        kv = policy.calibrate_qkv_fp8_scales(data)["layers"]
        assert list(kv) == [f"model.layers.{i}.self_attn.{t}_scale" for i in range(2) for t in "kv"]
        monkeypatch.setenv("FP8_MAX_K", "224")
        halved = policy.calibrate_qkv_fp8_scales(data)["layers"]
        for name, value in kv.items():
            factor = 2.0 if name.endswith("k_scale") else 1.0
            assert halved[name] == pytest.approx(factor * value, rel=1e-12), name
        assert fp8_kv.kv_cache_scales(kv, 2) == [
            (kv[fp8_kv.scale_name(i, "k")], kv[fp8_kv.scale_name(i, "v")]) for i in range(2)
        ]
    finally:
        policy.shutdown()


def test_kv_scale_checks():
    good = {fp8_kv.scale_name(i, w): 0.01 for i in range(2) for w in "qkv"}
    assert fp8_kv.kv_cache_scales(good, 2) == [(0.01, 0.01)] * 2  # q scales accepted, not used
    with pytest.raises(ValueError, match="has no 'model.layers.1.self_attn.v_scale'"):
        fp8_kv.kv_cache_scales({k: v for k, v in good.items() if k != fp8_kv.scale_name(1, "v")}, 2)
    with pytest.raises(ValueError, match="unexpected name"):
        fp8_kv.kv_cache_scales({**good, "model.layers.0.self_attn.q_scale": 1.0}, 2)  # the q name has .attn.
    with pytest.raises(ValueError, match="positive and finite"):
        fp8_kv.kv_cache_scales({**good, fp8_kv.scale_name(0, "k"): 0.0}, 2)
    with pytest.raises(ValueError, match="model has 1 layers"):
        fp8_kv.kv_cache_scales(good, 1)
    assert GenerationConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError):
        GenerationConfig.model_validate({"kv_cache_dtype": "fp16"})
    x = torch.tensor([1000.0, -1000.0, 3.0, 1e-9])
    assert fp8_kv.quantize(x, 1.0).dtype == torch.float8_e4m3fn
    assert fp8_kv.dequantize(fp8_kv.quantize(x, 1.0), 1.0, torch.float32).tolist() == [448.0, -448.0, 3.0, 0.0]
    # 1000 / 4 = 250 lies between the e4m3 neighbours 240 and 256 (step 16 in [128, 256)): 256, i.e. 1024 back
    assert fp8_kv.dequantize(fp8_kv.quantize(x, 4.0), 4.0, torch.float32).tolist()[:3] == [1024.0, -1024.0, 3.0]


# ---------------------------------------------------------------------------------------------- FP8 cache
def teacher_forced(decoder: Any, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Log-softmax [B, steps, V] after the prompt and after every fed token (prefill, then one step per token)."""
    batch, width = ids.shape
    key_valid = torch.ones((batch, prompt), dtype=torch.bool, device=ids.device)
    positions = torch.arange(prompt, device=ids.device).expand(batch, prompt)
    out = [decoder.start(ids[:, :prompt], key_valid, positions, width)]
    for t in range(prompt, width - 1):
        out.append(decoder.step(ids[:, t], torch.full((batch,), t, device=ids.device), t))
    return torch.stack(out, 1).float().log_softmax(-1)


def test_fp8_cache_logprobs_within_bound(tiny_model_dir, char_tokenizer):
    policy = Policy(small_policy_config(tiny_model_dir), char_tokenizer, init_reference_model=False)
    try:
        model = policy.generation_source.model.eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, len(char_tokenizer), (8, 40), generator=g)
        calib = BatchedDataDict(input_ids=ids, input_lengths=torch.full((8,), 40))
        scales = fp8_kv.kv_cache_scales(policy.calibrate_qkv_fp8_scales(calib, micro_batch_size=2)["layers"], 2)
        with torch.inference_mode():
            ref = teacher_forced(FastDecoder(model), ids, 6)
            fast = FastDecoder(model, native=True, kv_scales=scales)
            assert not fast.native  # the compiled step reads float32 caches: PyTorch ops with FP8
            fast_lp = teacher_forced(fast, ids, 6)
            assert all(c.dtype == torch.float8_e4m3fn for c in fast.k_cache + fast.v_cache)
            hf = HfDecoder(model, kv_scales=scales)
            hf_lp = teacher_forced(hf, ids, 6)
            assert all(layer.keys.dtype == torch.float8_e4m3fn for layer in hf.cache.layers)
            assert all(layer.keys.shape[2] == 39 for layer in hf.cache.layers)
            wrong = teacher_forced(FastDecoder(model, kv_scales=[(k / 10, v / 10) for k, v in scales]), ids, 6)
        assert (hf_lp - fast_lp).abs().max() <= 1e-5  # both decoders hold and read the same FP8 values
        err = (fast_lp - ref).abs()  # [B, steps, V]
        fed = torch.cat([ids[:, 6:7], ids[:, 7:]], 1)[..., None]  # the token each position goes on to
        assert 1e-4 < float(err.max()) <= MAX_LOGPROB_ERROR  # quantized (not a float32 cache), within the bound
        assert float(err.gather(-1, fed).mean()) <= MEAN_LOGPROB_ERROR
        assert float((wrong - ref).abs().max()) > MAX_LOGPROB_ERROR  # the bound does catch bad scales
    finally:
        policy.shutdown()


def test_generation_fp8_logprobs_vs_policy(tiny_model_dir, char_tokenizer, caplog):
    """HfGeneration with kv_cache_dtype=fp8: the sampled tokens' log-probs against the policy's full forward
    (what training compares them with); the float32 cache agrees to rounding, FP8 within the bound."""
    cfg = small_policy_config(tiny_model_dir, generation={"max_new_tokens": 24})
    policy = Policy(cfg, char_tokenizer, init_reference_model=False)
    try:
        prompts = ragged_rows(len(char_tokenizer), seed=3)
        layers = policy.calibrate_qkv_fp8_scales(prompts, include_q=True)["layers"]
        results = {}
        for dtype in ("auto", "fp8"):
            gen_cfg = cfg.generation.model_copy(update={"kv_cache_dtype": dtype})
            engine = HfGeneration(gen_cfg, char_tokenizer, policy.generation_source, seed=5)
            assert engine.requires_kv_scale_sync == (dtype == "fp8")
            if dtype == "fp8":
                with caplog.at_level("WARNING"):
                    engine.generate(prompts)  # no scales yet: unit scales, one warning
                assert "without calibrated scales" in caplog.text
                engine.set_kv_scales(layers)
                assert engine.kv_scales == layers
            engine.prepare_for_generation()
            out = engine.generate(prompts, seed=11)
            engine.finish_generation()
            seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
            train_lp = policy.get_logprobs(seqs)["logprobs"]
            generated = out["logprobs"] != 0
            results[dtype] = (out["logprobs"] - train_lp).abs()[generated]
        assert float(results["auto"].max()) <= 1e-4
        assert 1e-4 < float(results["fp8"].max()) <= MAX_LOGPROB_ERROR
        assert float(results["fp8"].mean()) <= MEAN_LOGPROB_ERROR
    finally:
        policy.shutdown()


def small_model(arch: str, vocab: int) -> Any:
    """A random 2-layer model: the test model (qwen2), a qwen3 (q/k norms) or a gpt2 (HF forward only)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    from relayrl.models.tiny import build_tiny_qwen2
    from tests.helpers import TEST_MODEL

    if arch == "qwen2":
        return build_tiny_qwen2(vocab, **TEST_MODEL)
    torch.manual_seed(0)
    if arch == "qwen3":
        config = Qwen3Config(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
        return Qwen3ForCausalLM(config)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gpt2"])
def test_fp8_generation_across_decoders(arch, char_tokenizer):
    """Ragged, repeated prompts (prefill fan-out) with ragged budgets (rows dropped mid-decode): with FP8 the fast
    decoder and the HF-forward decoder generate the same tokens; both stay within the bound of the float32 cache
    until the sampled tokens first differ."""
    model = small_model(arch, len(char_tokenizer)).eval()
    source = SimpleNamespace(model=model, weights_version=0)
    prompts = ragged_rows(len(char_tokenizer), [9, 4, 7, 2, 9, 4], seed=4)
    prompts["input_ids"][4:] = prompts["input_ids"][[0, 1]]  # rows 4, 5 repeat rows 0, 1
    amax: dict[str, float] = {}

    def observe(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for which, t in (("k", k), ("v", v)):
            name = fp8_kv.scale_name(module.layer_idx, which)
            amax[name] = max(amax.get(name, 0.0), float(t.abs().max()))

    with fp8_kv.observe_attention_inputs(model, observe), torch.no_grad():  # k/v maxima over 32 random tokens
        model(input_ids=torch.randint(2, len(char_tokenizer), (2, 16), generator=torch.Generator().manual_seed(0)))
    layers = {name: value * 1.05 / 448 for name, value in amax.items()}
    assert len(layers) == 4
    outs = {}
    for name, dtype, fast in (("ref", "auto", None), ("fp8_fast", "fp8", None), ("fp8_hf", "fp8", False)):
        if arch == "gpt2" and name == "fp8_fast":
            continue
        cfg = GenerationConfig(max_new_tokens=12, kv_cache_dtype=dtype, stop_token_ids=[])
        engine = HfGeneration(cfg, char_tokenizer, source, max_total_sequence_length=17, fast_path=fast)
        assert engine.uses_fast_path == (arch != "gpt2" and fast is None)
        engine.set_kv_scales(layers)
        outs[name] = engine.generate(prompts, seed=3)
    lengths = outs["ref"]["generation_lengths"]
    assert int(lengths.min()) < int(lengths.max())  # budgets differ: rows leave the batch
    if "fp8_fast" in outs:
        assert torch.equal(outs["fp8_fast"]["output_ids"], outs["fp8_hf"]["output_ids"])
        assert (outs["fp8_fast"]["logprobs"] - outs["fp8_hf"]["logprobs"]).abs().max() <= 1e-4
    ref_ids, fp8_ids = outs["ref"]["output_ids"], outs["fp8_hf"]["output_ids"]
    same_prefix = (ref_ids == fp8_ids).long().cumprod(1).bool()  # positions before the first differing token
    err = (outs["fp8_hf"]["logprobs"] - outs["ref"]["logprobs"]).abs()[same_prefix]
    assert int((outs["ref"]["logprobs"] != 0)[same_prefix].sum()) >= 20  # enough tokens compared
    assert float(err.max()) <= MAX_LOGPROB_ERROR


# ---------------------------------------------------------------------------------------------- refit
@pytest.mark.parametrize("colocated", [False, True])
def test_scales_travel_with_the_refit(colocated, tiny_model_dir, char_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))  # ZMQ IPC sockets private to this test
    placement: dict[str, Any] = (
        {"enabled": True} if colocated else {"enabled": False, "resources": {"num_nodes": 1, "workers_per_node": 2}}
    )
    cfg = small_policy_config(
        tiny_model_dir, generation={"max_new_tokens": 8, "kv_cache_dtype": "fp8", "colocated": placement}
    )
    cluster = ClusterConfig(workers_per_node=2 if colocated else 1)
    policy = Policy(cfg, char_tokenizer, cluster=cluster, init_reference_model=False)
    gen = DistributedGeneration(cfg.generation, char_tokenizer, policy, cluster=cluster, policy_config=cfg)
    sent: list[Any] = []
    broadcast = policy.broadcast_weights_for_collective

    def spy(kv_scales: Any = None) -> Any:
        sent.append(kv_scales)
        return broadcast(kv_scales)

    monkeypatch.setattr(policy, "broadcast_weights_for_collective", spy)
    try:
        assert gen.requires_kv_scale_sync and gen.world_size == 2
        prompts = ragged_rows(len(char_tokenizer))
        train = ragged_rows(len(char_tokenizer), [9, 5, 7, 3], seed=1)
        train["token_mask"] = (torch.arange(9)[None] < train["input_lengths"][:, None]).float()
        train["sample_mask"] = torch.ones(4)
        train["advantages"] = torch.randn(4, 1, generator=torch.Generator().manual_seed(2)).expand(4, 9).clone()
        train_on_policy(policy, train)  # the workers are one version behind
        layers = policy.calibrate_qkv_fp8_scales(prompts, include_q=True)["layers"]
        gen.set_kv_scales(layers)
        gen.prepare_for_generation()
        assert sent == ([] if colocated else [layers])  # in the collective broadcast itself
        assert gen.worker_kv_scales() == [layers, layers]
        assert gen.refit_metrics()["refit/total_count"] == 1

        engine = HfGeneration(cfg.generation, char_tokenizer, policy.generation_source)
        engine.set_kv_scales(layers)
        engine.prepare_for_generation()
        out, ref = gen.generate(prompts, greedy=True), engine.generate(prompts, greedy=True)
        assert torch.equal(out["output_ids"], ref["output_ids"])  # the workers decode with the same FP8 cache
        assert (out["logprobs"] - ref["logprobs"]).abs().max() <= 1e-5

        doubled = {k: 2 * v for k, v in layers.items()}
        gen.set_kv_scales(doubled)  # same weights: the scales go out alone
        gen.prepare_for_generation()
        assert gen.worker_kv_scales() == [doubled, doubled]
        assert gen.refit_metrics()["refit/total_count"] == 1 and len(sent) == (0 if colocated else 1)
    finally:
        gen.shutdown()
        policy.shutdown()


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
def test_fp8_cache_on_cuda_matches_cpu(tiny_model_dir, char_tokenizer):
    cfg = small_policy_config(tiny_model_dir)
    policy = Policy(cfg, char_tokenizer, init_reference_model=False)
    try:
        model = policy.generation_source.model.eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, len(char_tokenizer), (4, 24), generator=g)
        calib = BatchedDataDict(input_ids=ids, input_lengths=torch.full((4,), 24))
        layers = policy.calibrate_qkv_fp8_scales(calib)["layers"]
        scales = fp8_kv.kv_cache_scales(layers, 2)
        with torch.inference_mode():
            ref = teacher_forced(FastDecoder(model), ids, 5)  # float32 cache, CPU
            gpu_model = model.to("cuda")
            fast = FastDecoder(gpu_model, kv_scales=scales)
            cuda = teacher_forced(fast, ids.cuda(), 5).cpu()
            assert all(c.dtype == torch.float8_e4m3fn and c.is_cuda for c in fast.k_cache)
            hf = teacher_forced(HfDecoder(gpu_model, kv_scales=scales), ids.cuda(), 5).cpu()
        # Rounding differs between devices, so a value may land in the neighbouring FP8 bucket: the CPU bound.
        assert 1e-4 < float((cuda - ref).abs().max()) <= MAX_LOGPROB_ERROR
        assert float((hf - ref).abs().max()) <= MAX_LOGPROB_ERROR
        gen_cfg = cfg.generation.model_copy(update={"kv_cache_dtype": "fp8"})
        engine = HfGeneration(gen_cfg, char_tokenizer, policy.generation_source)
        engine.set_kv_scales(layers)
        engine.prepare_for_generation()
        out = engine.generate(ragged_rows(len(char_tokenizer)), greedy=True)
        assert math.isfinite(float(out["logprobs"].sum())) and out["output_ids"].shape[0] == len(LENGTHS)
    finally:
        policy.shutdown()

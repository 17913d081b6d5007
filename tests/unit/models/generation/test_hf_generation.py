"""HfGeneration against transformers itself: greedy tokens vs `model.generate`, log-probs vs a full forward pass."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from relayrl.config import ColocatedConfig, GenerationConfig
from relayrl.distributed import refit_manifest
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.fast.support import fast_path_unsupported
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.generation.sampling import TokenSampler, apply_top_k_top_p
from relayrl.models.tiny import build_tiny_qwen2
from tests.helpers import build_test_model
from tests.unit.models.fast.builders import SHAPE

PROMPTS = ["12+34=", "7-3=", "hello world!", "ab", "99-1=", "x"]


class Source:
    """Stands in for the policy: the live module and its optimizer-step counter."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights_version = 0


def _sharpen(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Re-draw weights at a large scale so a random model's greedy continuations vary instead of repeating a token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                embedding = "embed" in name or "wte" in name or "wpe" in name
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if embedding else 2.5 / math.sqrt(p.shape[1])))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def qwen2(char_tokenizer) -> torch.nn.Module:
    return _sharpen(build_test_model(char_tokenizer))


def _batch(tokenizer, prompts: list[str], stop_strings: list | None = None) -> BatchedDataDict:
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(len(e) for e in encoded) + 2  # extra right padding, as a data loader may leave
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    batch = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in encoded]))
    if stop_strings is not None:
        batch["stop_strings"] = stop_strings
    return batch


def _engine(tokenizer, model, fast_path: bool | None = None, **cfg) -> HfGeneration:
    return HfGeneration(GenerationConfig(**cfg), tokenizer, Source(model), fast_path=fast_path)


def _generated(out: BatchedDataDict, batch: BatchedDataDict, row: int) -> list[int]:
    start = int(batch["input_lengths"][row])
    return out["output_ids"][row, start : start + int(out["generation_lengths"][row])].tolist()


def _hf_greedy(model, prompt_ids: list[int], max_new: int, eos: int | list[int] | None) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


# ---------------------------------------------------------------------------------------------------- greedy
def _hf_model(model_cls: type, config_cls: type, vocab: int, **keys: Any) -> torch.nn.Module:
    """A sharpened random model of the fast-path tests' geometry (tests/unit/models/fast/builders.SHAPE) for `vocab`
    tokens, with room for 128 positions and `keys` on top."""
    torch.manual_seed(0)
    return _sharpen(model_cls(config_cls(**{**SHAPE, "vocab_size": vocab, "max_position_embeddings": 128, **keys})))


def _llama(vocab: int) -> torch.nn.Module:
    return _hf_model(LlamaForCausalLM, LlamaConfig, vocab, num_key_value_heads=1, attention_bias=True)


def _qwen3(vocab: int) -> torch.nn.Module:
    return _hf_model(Qwen3ForCausalLM, Qwen3Config, vocab, num_key_value_heads=2, head_dim=24)


def _gpt2(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return _sharpen(GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128)))


@pytest.mark.parametrize(
    "arch, fast_path",
    [("qwen2", True), ("qwen2", False), ("llama", True), ("qwen3", True), ("gpt2", None)],
)
def test_greedy_matches_hf_generate_per_row(char_tokenizer, qwen2, arch: str, fast_path: bool | None) -> None:
    vocab = len(char_tokenizer)
    model = {
        "qwen2": lambda: qwen2,
        "llama": lambda: _llama(vocab),
        "qwen3": lambda: _qwen3(vocab),
        "gpt2": lambda: _gpt2(vocab),
    }[arch]()
    engine = _engine(char_tokenizer, model, fast_path=fast_path, max_new_tokens=10, stop_token_ids=[])
    assert engine.uses_fast_path == (arch != "gpt2" and fast_path is not False)
    batch = _batch(char_tokenizer, PROMPTS)
    out = engine.generate(batch, greedy=True)
    distinct = set()
    for row, prompt in enumerate(PROMPTS):
        ids = char_tokenizer(prompt)["input_ids"]
        expected = _hf_greedy(model, ids, 10, eos=None)
        assert _generated(out, batch, row) == expected, f"row {row} ({prompt!r})"
        distinct.update(expected)
    assert len(distinct) > 5  # the model is not degenerate, so the comparison means something
    assert out["truncated"].all() and (out["generation_lengths"] == 10).all()


@pytest.mark.parametrize("fast_path", [True, False])
def test_greedy_with_stop_token_matches_hf_eos_and_drops_finished_rows(char_tokenizer, qwen2, fast_path: bool) -> None:
    """Repeated prompts (prefill fan-out) whose rows end at different steps (batch compaction) still match HF."""
    prompts = PROMPTS * 2
    free = _engine(char_tokenizer, qwen2, max_new_tokens=12, stop_token_ids=[]).generate(
        _batch(char_tokenizer, prompts), greedy=True
    )
    free_tokens = [_generated(free, _batch(char_tokenizer, prompts), r) for r in range(len(PROMPTS))]
    # Tokens the model emits early in rows 4 and 1: those rows stop after 1-2 steps, the others run on.
    stops = [free_tokens[4][0], free_tokens[1][1]]
    batch = _batch(char_tokenizer, prompts)
    engine = _engine(char_tokenizer, qwen2, fast_path=fast_path, max_new_tokens=12, stop_token_ids=stops)
    out = engine.generate(batch, greedy=True)
    ended_early = 0
    for row, prompt in enumerate(prompts):
        expected = _hf_greedy(qwen2, char_tokenizer(prompt)["input_ids"], 12, eos=stops)
        got = _generated(out, batch, row)
        assert got == expected, f"row {row}"
        hit = [i for i, t in enumerate(got) if t in stops]
        assert bool(out["truncated"][row]) == (not hit)
        if hit:
            assert hit == [len(got) - 1]  # stop token included, nothing after it
            ended_early += 1
        # everything after the generation is pad with logprob 0
        end = int(out["unpadded_sequence_lengths"][row])
        assert (out["output_ids"][row, end:] == char_tokenizer.pad_token_id).all()
        assert (out["logprobs"][row, end:] == 0).all()
    assert 0 < ended_early < len(prompts)


# ---------------------------------------------------------------------------------------------------- log-probs
def _forward_logprobs(
    model, out: BatchedDataDict, batch: BatchedDataDict, row: int, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    n = int(out["unpadded_sequence_lengths"][row])
    start = int(batch["input_lengths"][row])
    seq = out["output_ids"][row, :n]
    with torch.no_grad():
        logits = model(seq.unsqueeze(0)).logits[0].float() / temperature  # [n, V]
    logits = apply_top_k_top_p(logits, top_k, top_p)
    lp = logits.log_softmax(-1)[start - 1 : n - 1]  # predicts positions start..n-1
    return lp.gather(1, seq[start:n].unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, None, 1.0), (0.7, None, 1.0), (1.0, 5, 1.0), (1.3, None, 0.8), (0.9, 8, 0.9)],
)
def test_sampled_logprobs_equal_forward_pass_under_sampling_distribution(
    char_tokenizer, qwen2, temperature: float, top_k: int | None, top_p: float
) -> None:
    batch = _batch(char_tokenizer, PROMPTS)
    engine = _engine(char_tokenizer, qwen2, max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p)
    out = engine.generate(batch, seed=3)
    for row in range(len(PROMPTS)):
        start, n = int(batch["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
        expected = _forward_logprobs(qwen2, out, batch, row, temperature, top_k, top_p)
        got = out["logprobs"][row, start:n]
        assert torch.isfinite(got).all()  # never samples a filtered-out token
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert (out["logprobs"][row, :start] == 0).all()
        assert out["output_ids"][row, :start].tolist() == batch["input_ids"][row, :start].tolist()


def test_greedy_logprob_is_temperature_scaled_unfiltered(char_tokenizer, qwen2) -> None:
    batch = _batch(char_tokenizer, PROMPTS[:3])
    out = _engine(char_tokenizer, qwen2, max_new_tokens=6, temperature=0.5, top_k=3).generate(batch, greedy=True)
    for row in range(3):
        start, n = int(batch["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
        expected = _forward_logprobs(qwen2, out, batch, row, 0.5, None, 1.0)
        torch.testing.assert_close(out["logprobs"][row, start:n], expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------- stopping
def _first_stop(tokenizer, tokens: list[int], stops: list[str]) -> int | None:
    """Tokens kept by the stop-string rule: up to the one whose decoded prefix first contains a stop string."""
    for k in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:k]) for s in stops):
            return k
    return None


def test_stop_strings_global_and_per_row(char_tokenizer, qwen2) -> None:
    prompts = PROMPTS[:4]
    plain = _batch(char_tokenizer, prompts)
    free = _engine(char_tokenizer, qwen2, max_new_tokens=20, stop_token_ids=[]).generate(plain, greedy=True)
    tokens = [_generated(free, plain, r) for r in range(4)]
    common = char_tokenizer.decode(tokens[0][3:5])  # completed by row 0's 5th token
    own = char_tokenizer.decode(tokens[2][1:3])  # only row 2 asks for this one
    late = char_tokenizer.decode(tokens[1][14:16])  # beyond the decoded tail window of the first steps
    batch = _batch(char_tokenizer, prompts, stop_strings=[None, [late], [own], []])
    out = _engine(char_tokenizer, qwen2, max_new_tokens=20, stop_token_ids=[], stop_strings=[common]).generate(
        batch, greedy=True
    )
    for row in range(4):
        stops = [common] + ([own] if row == 2 else []) + ([late] if row == 1 else [])
        keep = _first_stop(char_tokenizer, tokens[row], stops)
        assert int(out["generation_lengths"][row]) == (keep or 20), f"row {row}: stops {stops}"
        assert bool(out["truncated"][row]) == (keep is None)
        assert _generated(out, batch, row) == tokens[row][: keep or 20]
    assert int(out["generation_lengths"][0]) <= 5 and int(out["generation_lengths"][2]) <= 3
    assert not out["truncated"][:3].any()


def test_max_total_sequence_length_caps_each_row(char_tokenizer, qwen2) -> None:
    batch = _batch(char_tokenizer, ["hello world!", "ab"])  # 12 and 2 prompt tokens
    engine = HfGeneration(
        GenerationConfig(max_new_tokens=8, stop_token_ids=[]),
        char_tokenizer,
        Source(qwen2),
        max_total_sequence_length=16,
    )
    out = engine.generate(batch)
    assert out["generation_lengths"].tolist() == [4, 8]
    assert out["unpadded_sequence_lengths"].tolist() == [16, 10]
    assert out["truncated"].tolist() == [True, True]
    assert out["output_ids"].shape == (2, batch["input_ids"].shape[1] + 8)
    with pytest.raises(ValueError, match="no room"):
        HfGeneration(GenerationConfig(), char_tokenizer, Source(qwen2), max_total_sequence_length=12).generate(batch)


# ---------------------------------------------------------------------------------------------------- RNG
def test_same_seed_same_samples_and_rng_state_resume(char_tokenizer, qwen2) -> None:
    batch = _batch(char_tokenizer, PROMPTS)
    a = _engine(char_tokenizer, qwen2, max_new_tokens=10)
    b = _engine(char_tokenizer, qwen2, max_new_tokens=10)
    first_a, first_b = a.generate(batch), b.generate(batch)
    assert torch.equal(first_a["output_ids"], first_b["output_ids"])
    state = a.get_rng_state()
    second = a.generate(batch)
    assert not torch.equal(second["output_ids"], first_a["output_ids"])
    a.set_rng_state(state)
    again = a.generate(batch)
    assert torch.equal(again["output_ids"], second["output_ids"])
    assert torch.equal(again["logprobs"], second["logprobs"])
    assert torch.equal(a.generate(batch, seed=7)["output_ids"], b.generate(batch, seed=7)["output_ids"])


def test_inverse_cdf_sampler_matches_distribution_and_filters() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5]]).repeat(20000, 1)  # [N, 6]
    sampler = TokenSampler(temperature=0.8, top_k=4, top_p=0.9, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sampler(logits)
    expected = apply_top_k_top_p(logits[:1] / 0.8, 4, 0.9).softmax(-1)[0]  # [6]
    freq = torch.bincount(tokens, minlength=6).float() / tokens.numel()
    assert (freq[expected == 0] == 0).all()
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])


def test_top_k_top_p_agrees_with_policy_side_filter() -> None:
    policy_logprobs = pytest.importorskip("relayrl.models.policy.logprobs")
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :3] = 5.0  # ties at the top-k boundary
    for top_k, top_p in [(3, 1.0), (None, 0.7), (10, 0.5), (1, 1.0), (50, 0.99)]:
        mine = apply_top_k_top_p(logits, top_k, top_p)
        theirs = policy_logprobs.apply_top_k_top_p(logits, top_k, top_p)
        assert torch.equal(torch.isinf(mine), torch.isinf(theirs)), (top_k, top_p)


# ---------------------------------------------------------------------------------------------------- weights
def test_stale_weights_refused_until_prepare_colocated(char_tokenizer, qwen2) -> None:
    source = Source(qwen2)
    engine = HfGeneration(GenerationConfig(max_new_tokens=4), char_tokenizer, source)
    batch = _batch(char_tokenizer, PROMPTS[:2])
    assert engine.prepare_for_generation() and engine.prepare_for_generation()  # idempotent
    engine.generate(batch)
    source.weights_version += 1
    with pytest.raises(RuntimeError, match="stale weights"):
        engine.generate(batch)
    engine.prepare_for_generation()
    assert engine.synced_weights_version == 1
    engine.generate(batch)
    assert engine.model is qwen2  # colocated: the policy's own module, no copy


def test_non_colocated_copy_refits_only_on_prepare(char_tokenizer) -> None:
    sizes = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    policy = _sharpen(build_tiny_qwen2(len(char_tokenizer), **sizes), seed=5)
    source = Source(policy)
    cfg = GenerationConfig(max_new_tokens=8, stop_token_ids=[], colocated=ColocatedConfig(enabled=False))
    engine = HfGeneration(cfg, char_tokenizer, source)
    assert engine.model is not policy
    batch = _batch(char_tokenizer, PROMPTS[:3])
    before = engine.generate(batch, greedy=True)
    with torch.no_grad():
        policy.lm_head.weight.mul_(-1.0)  # tied with the embedding: every logit changes
    source.weights_version += 1
    with pytest.raises(RuntimeError, match="stale weights"):
        engine.generate(batch, greedy=True)
    assert not torch.equal(engine.model.lm_head.weight, policy.lm_head.weight)  # a real, separate copy
    engine.prepare_for_generation()
    assert torch.equal(engine.model.lm_head.weight, policy.lm_head.weight)
    after = engine.generate(batch, greedy=True)
    reference = _engine(char_tokenizer, policy, max_new_tokens=8, stop_token_ids=[]).generate(batch, greedy=True)
    assert torch.equal(after["output_ids"], reference["output_ids"])
    assert not torch.equal(after["output_ids"], before["output_ids"])


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_snapshot_refit_reads_the_snapshot_without_a_copy(char_tokenizer, precision: str) -> None:
    """Issue 27 item 4 in one process: async GRPO's producer engine (thread or process) takes a published snapshot as
    its weights (the snapshot's storage, no copy) and generates exactly what an engine reading the policy in place
    does; a bf16 engine decodes from its bf16 compute copy of it. The snapshot copies the tied embedding once; a
    snapshot that does not match the module (another dtype) is copied instead."""
    sizes = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    policy = _sharpen(build_tiny_qwen2(len(char_tokenizer), **sizes), seed=5)
    cfg = GenerationConfig(max_new_tokens=8, stop_token_ids=[], colocated=ColocatedConfig(enabled=False))
    pin = Source(policy)  # the version the producer's engine generates as
    engine = HfGeneration(cfg, char_tokenizer, pin, precision=precision)
    with torch.no_grad():
        policy.lm_head.weight.mul_(-1.0)  # a training step: the engine's copy is stale
    snap = refit_manifest.snapshot(policy.state_dict().items())
    assert snap["lm_head.weight"] is snap["model.embed_tokens.weight"]  # tied: one copy
    engine.load_weights(snap, 1)
    pin.weights_version = 1
    ptrs = {name: t.data_ptr() for name, t in snap.items()}
    assert {name: t.data_ptr() for name, t in engine.model.state_dict().items()} == ptrs  # read in place
    batch = _batch(char_tokenizer, PROMPTS[:3])
    out = engine.generate(batch, greedy=True)
    colocated = GenerationConfig(max_new_tokens=8, stop_token_ids=[])
    ref = HfGeneration(colocated, char_tokenizer, Source(policy), precision=precision).generate(batch, greedy=True)
    assert torch.equal(out["output_ids"], ref["output_ids"]) and torch.equal(out["logprobs"], ref["logprobs"])
    if engine.compute_weights is not None:  # bf16: its compute copy, made from the snapshot
        copies = engine.compute_weights.copies().values()
        assert copies and all(c.dtype == torch.bfloat16 and c.data_ptr() not in ptrs.values() for c in copies)
    engine.load_weights({k: v.double() for k, v in snap.items()}, 2)  # no match: copied into the module
    assert {name: t.data_ptr() for name, t in engine.model.state_dict().items()} == ptrs


def test_prepare_and_finish_restore_train_mode_and_shutdown(char_tokenizer, qwen2) -> None:
    qwen2.train()
    try:
        engine = HfGeneration(GenerationConfig(max_new_tokens=3), char_tokenizer, Source(qwen2))
        engine.prepare_for_generation()
        assert not qwen2.training
        engine.generate(_batch(char_tokenizer, ["ab"]))
        assert engine.finish_generation() and qwen2.training
        assert engine.shutdown() and engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            engine.generate(_batch(char_tokenizer, ["ab"]))
    finally:
        qwen2.eval()


# ---------------------------------------------------------------------------------------------------- input / output
def test_bad_input_lengths_and_empty_batch(char_tokenizer, qwen2) -> None:
    engine = _engine(char_tokenizer, qwen2, max_new_tokens=5)
    batch = _batch(char_tokenizer, ["ab", "abc"])
    for bad in ([0, 3], [2, batch["input_ids"].shape[1] + 1]):
        with pytest.raises(ValueError, match="input_lengths"):
            engine.generate(BatchedDataDict(input_ids=batch["input_ids"], input_lengths=torch.tensor(bad)))
    with pytest.raises(ValueError, match="stop_strings"):
        engine.generate(_batch(char_tokenizer, ["ab", "abc"], stop_strings=[["x"]]))
    with pytest.raises(ValueError, match="stop_strings"):
        engine.generate(_batch(char_tokenizer, ["ab", "abc"], stop_strings=["x", None]))
    empty = engine.generate(
        BatchedDataDict(input_ids=torch.zeros((0, 4), dtype=torch.long), input_lengths=torch.zeros(0, dtype=torch.long))
    )
    assert empty["output_ids"].shape == (0, 9) and empty["logprobs"].shape == (0, 9)
    assert empty["generation_lengths"].shape == (0,) and empty["truncated"].dtype == torch.bool


def test_outputs_are_ordinary_tensors_usable_in_training(char_tokenizer, qwen2) -> None:
    out = _engine(char_tokenizer, qwen2, max_new_tokens=4).generate(_batch(char_tokenizer, ["ab", "12+3="]))
    assert not out["output_ids"].is_inference() and not out["logprobs"].is_inference()
    emb = torch.nn.Embedding(len(char_tokenizer), 4)
    emb(out["output_ids"]).sum().backward()  # would fail on inference tensors
    assert out["output_ids"].dtype == torch.long and out["logprobs"].dtype == torch.float32


def test_fast_path_refuses_unsupported_models(char_tokenizer) -> None:
    gpt2 = _gpt2(len(char_tokenizer))
    assert "model_type" in fast_path_unsupported(gpt2, lm_head=True)
    with pytest.raises(ValueError, match="fast_path=True"):
        _engine(char_tokenizer, gpt2, fast_path=True)


def test_chunked_prefill_matches_single_prefill(char_tokenizer, qwen2, monkeypatch) -> None:
    from relayrl.models.fast import decoder

    batch = _batch(char_tokenizer, PROMPTS)
    whole = _engine(char_tokenizer, qwen2, max_new_tokens=6).generate(batch, greedy=True)
    monkeypatch.setattr(decoder, "PREFILL_TOKENS_PER_CHUNK", 20)  # one or two rows per chunk
    chunked = _engine(char_tokenizer, qwen2, max_new_tokens=6).generate(batch, greedy=True)
    assert torch.equal(whole["output_ids"], chunked["output_ids"])
    torch.testing.assert_close(whole["logprobs"], chunked["logprobs"], atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_generation_matches_forward_pass(char_tokenizer, qwen2, dtype: torch.dtype) -> None:
    import copy

    model = copy.deepcopy(qwen2).to("cuda", dtype)
    batch = _batch(char_tokenizer, PROMPTS)
    engine = _engine(char_tokenizer, model, max_new_tokens=12, temperature=0.8, top_k=20)
    assert engine.uses_fast_path
    out = engine.generate(batch, seed=0)
    again = _engine(char_tokenizer, model, max_new_tokens=12, temperature=0.8, top_k=20).generate(batch, seed=0)
    assert torch.equal(out["output_ids"], again["output_ids"])
    tolerance = 1e-3 if dtype == torch.float32 else 0.15
    for row in range(len(PROMPTS)):
        start, n = int(batch["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
        seq = out["output_ids"][row, :n].cuda()
        with torch.no_grad():
            logits = model(seq.unsqueeze(0)).logits[0].float() / 0.8
        expected = apply_top_k_top_p(logits, 20, 1.0).log_softmax(-1)[start - 1 : n - 1]
        expected = expected.gather(1, seq[start:].unsqueeze(1)).squeeze(1).cpu()
        torch.testing.assert_close(out["logprobs"][row, start:n], expected, atol=tolerance, rtol=0)
    if dtype == torch.float32:
        greedy = engine.generate(batch, greedy=True)
        for row, prompt in enumerate(PROMPTS):
            ids = char_tokenizer(prompt)["input_ids"]
            with torch.inference_mode():
                ref = model.generate(
                    torch.tensor([ids], device="cuda"),
                    do_sample=False,
                    max_new_tokens=12,
                    eos_token_id=char_tokenizer.eos_token_id,
                    pad_token_id=0,
                )
            assert (
                _generated(greedy, batch, row) == ref[0, len(ids) :].tolist()[: int(greedy["generation_lengths"][row])]
            )


@pytest.mark.parametrize("fast_path", [True, False])
def test_sampling_is_invariant_to_splitting_the_batch(char_tokenizer, qwen2, fast_path):
    """Rows [0:k] and [k:B] generated apart with their slices of U give the whole batch's tokens and logprobs."""
    prompts = PROMPTS + ["3+4=", "hello"]
    batch = _batch(char_tokenizer, prompts)
    cfg = dict(max_new_tokens=10, temperature=1.5, top_k=30, top_p=0.95, stop_strings=["e", "1", "=", " ", "a"])
    whole_engine = _engine(char_tokenizer, qwen2, fast_path=fast_path, **cfg)
    whole = whole_engine.generate(batch)
    uniforms = torch.rand((len(prompts), 10), generator=torch.Generator().manual_seed(0))  # the engine's own draw
    assert torch.equal(
        _engine(char_tokenizer, qwen2, fast_path=fast_path, **cfg).generate(batch, uniforms=uniforms)["output_ids"],
        whole["output_ids"],
    )
    lengths = whole["generation_lengths"]
    assert 0 < int(lengths.min()) and int(lengths.min()) < int(lengths.max())  # rows end at different steps
    for k in (1, 3, 5):
        parts = [
            _engine(char_tokenizer, qwen2, fast_path=fast_path, **cfg).generate(
                batch.slice(a, b), uniforms=uniforms[a:b]
            )
            for a, b in ((0, k), (k, len(prompts)))
        ]
        for key in ("generation_lengths", "truncated", "unpadded_sequence_lengths"):
            assert torch.equal(torch.cat([p[key] for p in parts]), whole[key]), key
        for r in range(len(prompts)):
            part, i = (parts[0], r) if r < k else (parts[1], r - k)
            n = int(whole["unpadded_sequence_lengths"][r])
            assert part["output_ids"][i, :n].tolist() == whole["output_ids"][r, :n].tolist()
            # same tokens; logprobs to float rounding (another batch shape sums the same values in another order)
            assert (part["logprobs"][i, :n] - whole["logprobs"][r, :n]).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="uniforms must be"):
        whole_engine.generate(batch, uniforms=uniforms[:, :3])

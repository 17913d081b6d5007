"""The fast backbone forward against HF's own: hidden states, next-token log-probs and every parameter's gradient."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from relayrl.models.fast.forward import backbone_hidden_states, fast_hidden_states, hf_hidden_states
from relayrl.models.fast.support import fast_path_unsupported
from relayrl.models.policy import logprobs as lp_ops
from relayrl.models.tiny import build_tiny_qwen2
from tests.unit.models.fast.builders import ATOL, VOCAB, llama_gqa, mistral, qwen2_bench, qwen3, randomize

LENGTHS = [7, 16, 1, 11, 16, 3]  # ragged, right-padded to 16; one full row and a one-token row


def _qwen2_shipped() -> PreTrainedModel:
    return randomize(build_tiny_qwen2(vocab_size=VOCAB))  # defaults: the shipped model's shape


def _shipped() -> PreTrainedModel:
    """The trained weights of builtin:tiny-arith, as the policy loads them."""
    from transformers import AutoModelForCausalLM

    from relayrl.utils.paths import resolve_model_path

    return AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-arith"), dtype=torch.float32).eval()


SUPPORTED: dict[str, Callable[[], PreTrainedModel]] = {
    "qwen2-shipped-shape": _qwen2_shipped,
    "tiny-arith": _shipped,
    "qwen2-bench": qwen2_bench,
    "llama-gqa": llama_gqa,
    "qwen3-qknorm": qwen3,
    "mistral": mistral,
}


def _batch(lengths: list[int] = LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, S] (pad id 0), lengths [B] and the real-token mask [B, S]."""
    gen = torch.Generator().manual_seed(seed)
    seq = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), seq), generator=gen)
    lens = torch.tensor(lengths)
    real = torch.arange(seq)[None, :] < lens[:, None]
    return ids.masked_fill(~real, 0), lens, real


def _logprobs(model: PreTrainedModel, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp, _ = lp_ops.next_token_logprobs(hidden, model.get_output_embeddings(), ids, temperature=0.7, chunk_size=5)
    return lp  # [B, S-1]


def _scored(lens: torch.Tensor, seq: int) -> torch.Tensor:
    """[B, S-1] positions whose next token is real (what every loss reads)."""
    return torch.arange(seq - 1)[None, :] < (lens - 1)[:, None]


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    m = SUPPORTED[request.param]()
    assert fast_path_unsupported(m) is None
    return m


def test_hidden_states_and_logprobs_match_hf(model: PreTrainedModel) -> None:
    ids, lens, real = _batch()
    with torch.no_grad():
        want = hf_hidden_states(model, ids, lens)
        got = backbone_hidden_states(model, ids, lens, fast=True)
        assert got.shape == want.shape
        torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)
        assert not got[~real].any()  # padding positions are zero on the fast path
        scored = _scored(lens, ids.shape[1])
        torch.testing.assert_close(
            _logprobs(model, got, ids)[scored], _logprobs(model, want, ids)[scored], atol=ATOL, rtol=0
        )


def test_unpadded_batch_matches_hf(model: PreTrainedModel) -> None:
    ids, lens, _ = _batch([9, 9, 9])
    with torch.no_grad():
        torch.testing.assert_close(
            fast_hidden_states(model, ids, lens), hf_hidden_states(model, ids, lens), atol=ATOL, rtol=0
        )


def test_empty_row_computes_position_zero_like_hf(model: PreTrainedModel) -> None:
    ids, lens, _ = _batch([0, 5])
    with torch.no_grad():
        got, want = fast_hidden_states(model, ids, lens), hf_hidden_states(model, ids, lens)
    torch.testing.assert_close(got[0, 0], want[0, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=ATOL, rtol=0)


def _grads(model: PreTrainedModel, hidden_fn: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    ids, lens, _ = _batch()
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    lp = _logprobs(model, hidden_fn(model, ids, lens), ids)
    (lp * weights * _scored(lens, ids.shape[1])).sum().backward()  # a masked sum, as the losses take
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _prefixed(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_gradients_match_hf(model: PreTrainedModel, checkpointing: str | None) -> None:
    m = copy.deepcopy(model).train()
    if checkpointing is not None:
        m.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        assert fast_path_unsupported(m) is None  # HF's input-grads hook on the embeddings is reproduced
    want = _grads(m, hf_hidden_states)
    got = _grads(m, functools.partial(backbone_hidden_states, fast=True))
    assert set(got) == {name for name, _ in m.named_parameters()}  # every parameter receives a gradient
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=ATOL, rtol=0, msg=_prefixed(name))


def test_frozen_embeddings_with_reentrant_checkpointing_match_hf() -> None:
    """HF's input-grads hook is what lets reentrant checkpointing backprop past frozen embeddings; it is honoured."""
    m = SUPPORTED["llama-gqa"]().train()
    m.get_input_embeddings().weight.requires_grad_(False)
    m.activation_checkpointing_enable({"use_reentrant": True})
    want = _grads(m, hf_hidden_states)
    got = _grads(m, functools.partial(backbone_hidden_states, fast=True))
    assert set(got) == set(want) and "model.layers.0.mlp.up_proj.weight" in got
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=ATOL, rtol=0, msg=_prefixed(name))


def test_runs_under_inference_mode() -> None:
    m = SUPPORTED["qwen2-bench"]().train()
    m.activation_checkpointing_enable({"use_reentrant": False})
    ids, lens, real = _batch()
    with torch.inference_mode():
        got, want = backbone_hidden_states(m, ids, lens, fast=True), hf_hidden_states(m, ids, lens)
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)


def test_fast_path_reads_live_weights_without_copies(model: PreTrainedModel) -> None:
    """An in-place weight update (an optimizer step, a refit) is seen by the next call."""
    m = copy.deepcopy(model)
    ids, lens, real = _batch()
    with torch.no_grad():
        before = fast_hidden_states(m, ids, lens)
        backbone = m.get_decoder()
        backbone.layers[-1].mlp.down_proj.weight.mul_(2.0)
        after = fast_hidden_states(m, ids, lens)
        assert not torch.allclose(before[real], after[real])
        torch.testing.assert_close(after[real], hf_hidden_states(m, ids, lens)[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen2-bench", "llama-gqa", "qwen3-qknorm"])
def test_bf16_autocast_matches_hf_under_autocast(name: str) -> None:
    model = SUPPORTED[name]()
    ids, lens, real = _batch()
    scored = _scored(lens, ids.shape[1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = hf_hidden_states(model, ids, lens)
        got = backbone_hidden_states(model, ids, lens, fast=True)
        lp_want, lp_got = _logprobs(model, want, ids), _logprobs(model, got, ids)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(lp_got[scored], lp_want[scored], atol=3e-2, rtol=2e-2)


def test_bf16_weights_match_hf() -> None:
    model = qwen3().bfloat16()
    ids, lens, real = _batch()
    with torch.no_grad():
        got, want = fast_hidden_states(model, ids, lens), hf_hidden_states(model, ids, lens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=3e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------------- fallbacks
SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32
)


def _sliding_qwen2() -> PreTrainedModel:
    config = Qwen2Config(**SMALL, num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    return Qwen2ForCausalLM(config).eval()


def _sliding_mistral() -> PreTrainedModel:
    return MistralForCausalLM(MistralConfig(**SMALL, num_hidden_layers=1, sliding_window=4)).eval()


def _dynamic_rope_llama() -> PreTrainedModel:
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = LlamaConfig(**SMALL, num_hidden_layers=1, max_position_embeddings=8, rope_parameters=rope)
    return LlamaForCausalLM(config).eval()


def _gpt2() -> PreTrainedModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()


class _Adapter(nn.Linear):
    """Stands in for a LoRA / quantised projection: same interface, different forward."""


def _adapted_qwen2() -> PreTrainedModel:
    model = build_tiny_qwen2(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32
    )
    proj = model.model.layers[0].self_attn.q_proj
    adapter = _Adapter(proj.in_features, proj.out_features)
    adapter.load_state_dict(proj.state_dict())
    model.model.layers[0].self_attn.q_proj = adapter
    return model


def _hooked_qwen2() -> PreTrainedModel:
    model = build_tiny_qwen2(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32
    )
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *_: None)  # e.g. FP8 calibration
    return model


def _dropout_qwen2_training() -> PreTrainedModel:
    model = build_tiny_qwen2(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32
    )
    model.config.attention_dropout = 0.1
    return model.train()


UNSUPPORTED: dict[str, tuple[Callable[[], PreTrainedModel], str]] = {
    "qwen2-sliding": (_sliding_qwen2, "sliding"),
    "mistral-sliding": (_sliding_mistral, "sliding"),
    "llama-dynamic-rope": (_dynamic_rope_llama, "rope_type"),
    "gpt2": (_gpt2, "model_type"),
    "adapter": (_adapted_qwen2, "nn.Linear"),
    "hooks": (_hooked_qwen2, "hooks"),
    "dropout-training": (_dropout_qwen2_training, "dropout"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_models_fall_back_to_hf(name: str) -> None:
    build, why = UNSUPPORTED[name]
    model = build()
    reason = fast_path_unsupported(model)
    assert reason is not None and why in reason
    ids, lens, _ = _batch()
    torch.manual_seed(0)  # attention dropout draws random numbers: same seed, same draws on both calls
    with torch.no_grad():
        got = backbone_hidden_states(model, ids, lens)
        torch.manual_seed(0)
        want = hf_hidden_states(model, ids, lens)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # HF's own forward, padding positions included
    with pytest.raises(ValueError, match="fast=True"):
        backbone_hidden_states(model, ids, lens, fast=True)


def test_fast_false_forces_hf() -> None:
    model = qwen2_bench()
    ids, lens, real = _batch()
    with torch.no_grad():
        got = backbone_hidden_states(model, ids, lens, fast=False)
        want = hf_hidden_states(model, ids, lens)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got[~real].abs().sum() > 0  # HF fills padding positions; the fast path would leave zeros


def test_dropout_model_in_eval_mode_uses_fast_path() -> None:
    model = _dropout_qwen2_training().eval()
    assert fast_path_unsupported(model) is None
    ids, lens, real = _batch()
    with torch.no_grad():
        got, want = fast_hidden_states(model, ids, lens), hf_hidden_states(model, ids, lens)
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)


def test_bare_backbone_matches_hf() -> None:
    """A critic's backbone (no LM head, as the value model holds it) takes the same fast path."""
    backbone = SUPPORTED["qwen3-qknorm"]().get_decoder()
    assert fast_path_unsupported(backbone) is None
    ids, lens, real = _batch()
    with torch.no_grad():
        got, want = backbone_hidden_states(backbone, ids, lens, fast=True), hf_hidden_states(backbone, ids, lens)
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)


def test_the_lm_head_counts_only_for_generation() -> None:
    """The full-sequence passes apply the head themselves, so an adapted head or a bare backbone does not stop them;
    the decoder runs the head too (`lm_head=True`), so there both are refused."""
    model = qwen2_bench()
    head = model.lm_head
    model.lm_head = _Adapter(head.in_features, head.out_features, bias=False)
    assert fast_path_unsupported(model) is None
    assert "nn.Linear" in (fast_path_unsupported(model, lm_head=True) or "")
    backbone = model.get_decoder()
    assert fast_path_unsupported(backbone) is None
    assert "lm_head" in (fast_path_unsupported(backbone, lm_head=True) or "")
    assert fast_path_unsupported(qwen2_bench(), lm_head=True) is None

"""The selective forward (only the positions a loss reads, shared prefixes computed once) against HF's full forward:
hidden states, log-probs and every parameter's gradient, on GRPO-shaped batches (rows repeating a prompt)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from relayrl.algorithms.loss_functions import ClippedPGLossFn, NLLLossFn
from relayrl.config import ClippedPGLossConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.fast import packing
from relayrl.models.fast.forward import hf_hidden_states, selected_hidden_states
from relayrl.models.fast.packing import SharedPacking, prefix_owners
from relayrl.models.fast.support import fast_path_unsupported
from relayrl.models.policy import logprobs as lp_ops
from relayrl.models.policy.worker import PolicyWorker
from tests.unit.models.fast.builders import ATOL, VOCAB, llama_gqa, qwen2_bench, qwen3


def _llama_gqa() -> PreTrainedModel:
    return llama_gqa(3, pad_token_id=None, rope=None)  # three layers, no padding_idx, default RoPE


MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "qwen2-bench": qwen2_bench,
    "llama-gqa": _llama_gqa,
    "qwen3": qwen3,
}


def grpo_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, S], lengths [B], loss positions [B, S-1]: 3 prompts x 3 generations, ragged, plus edge rows.

    Rows 0-2 share prompt A (5 tokens) and rows 1-2 also share their first 2 generated tokens; rows 3-5 share prompt B
    (3 tokens); rows 6-8 have prompt C (4 tokens) and row 8 is an exact copy of row 6. Row 9 is one token long and row
    10 empty (neither predicts anything); row 11 is prompt A again with a generation nobody selected.
    """
    gen = torch.Generator().manual_seed(seed)
    seq = 16
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (5, 3, 4)]
    rows, lengths, prompt_len = [], [], []
    for p, total in zip(prompts, ((16, 11, 14), (9, 16, 6), (13, 10, 13))):
        for length in total:
            tail = torch.randint(1, VOCAB, (seq - len(p),), generator=gen)
            rows.append(torch.cat([p, tail]))
            lengths.append(length)
            prompt_len.append(len(p))
    rows[2][5:7] = rows[1][5:7]
    rows[8] = rows[6].clone()
    rows += [torch.randint(1, VOCAB, (seq,), generator=gen), torch.zeros(seq, dtype=torch.long), rows[0].clone()]
    lengths += [1, 0, 12]
    prompt_len += [1, 0, 5]
    ids = torch.stack(rows)
    lens = torch.tensor(lengths)
    cols = torch.arange(seq)
    ids = ids.masked_fill(cols[None, :] >= lens[:, None], 0)
    # Position t predicts token t+1: a loss position when token t+1 is generated (and real).
    target = cols[None, 1:]
    select = (target >= torch.tensor(prompt_len)[:, None]) & (target < lens[:, None])  # [B, S-1]
    select[11] = False
    select[4, 7] = False  # a hole inside a row: the positions around it are still computed
    return ids, lens, select


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    m = MODELS[request.param]()
    assert fast_path_unsupported(m) is None
    return m


def _pad_select(select: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(select, (0, 1))  # [B, S]: position t of the hidden states


def test_prefix_owners_match_brute_force() -> None:
    ids, lens, select = grpo_batch()
    full = _pad_select(select)
    kept = torch.tensor([int(r.nonzero().max()) + 1 if r.any() else 0 for r in full])
    owner = prefix_owners(ids, kept)
    for b in range(ids.shape[0]):
        for t in range(int(kept[b])):
            want = min(o for o in range(ids.shape[0]) if kept[o] > t and torch.equal(ids[o, : t + 1], ids[b, : t + 1]))
            assert int(owner[b, t]) == want, (b, t)
    pk = SharedPacking(ids, lens, full)
    distinct = {tuple(ids[b, : t + 1].tolist()) for b in range(ids.shape[0]) for t in range(int(kept[b]))}
    assert pk.num_tokens == len(distinct) < int(kept.sum())  # one packed token per distinct prefix
    assert pk.seq == int(kept.max()) and pk.num_selected == int(select.sum())


def test_small_comparison_blocks_give_the_same_owners(monkeypatch: pytest.MonkeyPatch) -> None:
    ids, _, select = grpo_batch()
    kept = torch.full((ids.shape[0],), ids.shape[1])
    want = prefix_owners(ids, kept)
    monkeypatch.setattr(packing, "COMPARE_BLOCK_ELEMENTS", 1)
    assert torch.equal(prefix_owners(ids, kept), want)


def test_selected_hidden_states_match_hf(model: PreTrainedModel) -> None:
    ids, lens, select = grpo_batch()
    full = _pad_select(select)
    with torch.no_grad():
        want = hf_hidden_states(model, ids, lens)[full]  # [M, H]
        got = selected_hidden_states(model, ids, lens, full, fast=True)
        hf = selected_hidden_states(model, ids, lens, full, fast=False)
    assert got.shape == want.shape == (int(select.sum()), want.shape[1])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(hf, want, atol=0, rtol=0)


def test_nothing_selected_is_empty(model: PreTrainedModel) -> None:
    ids, lens, select = grpo_batch()
    with torch.no_grad():
        got = selected_hidden_states(model, ids, lens, torch.zeros_like(ids, dtype=torch.bool), fast=True)
    assert got.shape == (0, model.config.hidden_size)


def _full_logprobs(model: PreTrainedModel, ids: torch.Tensor, lens: torch.Tensor, **kw: Any) -> torch.Tensor:
    hidden = hf_hidden_states(model, ids, lens)
    lp, _ = lp_ops.next_token_logprobs(hidden, model.get_output_embeddings(), ids, **kw)
    return lp  # [B, S-1]


def _selected_logprobs(model: PreTrainedModel, ids: torch.Tensor, lens: torch.Tensor, select: torch.Tensor, **kw: Any):
    hidden = selected_hidden_states(model, ids, lens, _pad_select(select), fast=True)
    return lp_ops.selected_logprobs(hidden, model.get_output_embeddings(), ids[:, 1:][select], **kw)


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant"])
def test_logprobs_and_gradients_match_hf(model: PreTrainedModel, checkpointing: str | None) -> None:
    m = copy.deepcopy(model).train()
    if checkpointing is not None:
        m.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    ids, lens, select = grpo_batch()
    weights = torch.randn(select.shape, generator=torch.Generator().manual_seed(3))  # [B, S-1]

    want_lp = _full_logprobs(m, ids, lens, temperature=0.7)
    (want_lp * weights * select).sum().backward()
    want = {name: p.grad.clone() for name, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)

    got_lp, _ = _selected_logprobs(m, ids, lens, select, temperature=0.7, chunk_size=7)  # [M], several chunks
    (got_lp * weights[select]).sum().backward()
    torch.testing.assert_close(got_lp, want_lp[select].detach(), atol=ATOL, rtol=0)
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want[name], atol=ATOL, rtol=0, msg=lambda msg, n=name: f"{n}: {msg}")


def test_filtered_and_unfiltered_logprobs_match_the_full_pass() -> None:
    model = qwen2_bench()
    ids, lens, select = grpo_batch()
    kw: dict[str, Any] = dict(temperature=0.9, top_k=20, top_p=0.8, return_unfiltered=True)
    with torch.no_grad():
        hidden = hf_hidden_states(model, ids, lens)
        want, want_plain = lp_ops.next_token_logprobs(hidden, model.get_output_embeddings(), ids, **kw)
        got, got_plain = _selected_logprobs(model, ids, lens, select, chunk_size=5, **kw)
    assert want_plain is not None and got_plain is not None
    finite = torch.isfinite(want[select])
    assert (~finite).any() and torch.equal(torch.isfinite(got), finite)  # some targets are filtered out
    torch.testing.assert_close(got[finite], want[select][finite], atol=ATOL, rtol=0)
    torch.testing.assert_close(got_plain, want_plain[select], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- the worker
@pytest.fixture(scope="module")
def worker(tiny_model_dir: Any, char_tokenizer: Any) -> PolicyWorker:
    cfg = PolicyConfig.model_validate(
        dict(model_name=str(tiny_model_dir), train_global_batch_size=12, train_micro_batch_size=12, max_grad_norm=1.0)
    )
    return PolicyWorker(cfg, char_tokenizer, device="cpu")


def _train_batch(vocab: int) -> BatchedDataDict:
    ids, lens, select = grpo_batch()
    ids = ids % vocab
    token_mask = torch.nn.functional.pad(select.float(), (1, 0))  # [B, S]: token t carries loss
    g = torch.Generator().manual_seed(5)
    b, s = ids.shape
    prev = -3.0 * torch.rand(b, s, generator=g)
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lens,
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0] * 7 + [0.0] + [1.0] * 4),  # row 7's loss positions drop out too
        advantages=torch.randn(b, 1, generator=g).expand(b, s).clone(),
        prev_logprobs=prev,
        generation_logprobs=prev + 0.01 * torch.randn(b, s, generator=g),
        reference_policy_logprobs=prev - 0.05 * torch.rand(b, s, generator=g),
    )


@pytest.mark.parametrize("loss_name", ["clipped-pg", "nll"])
def test_worker_loss_and_gradients_match_a_transformers_forward(
    worker: PolicyWorker, tiny_model_dir: Any, char_tokenizer: Any, loss_name: str
) -> None:
    """The worker's micro-batch loss (selective forward) equals the same loss on HF's full-vocabulary log-probs."""
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig()) if loss_name == "clipped-pg" else NLLLossFn()
    data = _train_batch(len(char_tokenizer))
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    seqs, toks = data["sample_mask"].sum(), mask.sum()
    model = worker.model.train()
    model.zero_grad(set_to_none=True)
    loss, metrics = worker._microbatch_loss(loss_fn)(data.copy(), seqs, toks)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    ref.load_state_dict(model.state_dict())
    ids, lens = data["input_ids"], data["input_lengths"]
    attn = (torch.arange(ids.shape[1])[None, :] < lens.clamp(min=1)[:, None]).long()
    logits = ref(input_ids=ids, attention_mask=attn).logits.float()  # [B, S, V]
    lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, S-1]
    lp = torch.where(mask.bool(), lp, data["prev_logprobs"][:, 1:])  # the worker's values off the loss positions
    want_loss, want_metrics = loss_fn(lp, data.copy(), seqs, toks)
    want_loss.backward()
    assert loss.item() == pytest.approx(want_loss.item(), abs=1e-6)
    for key, value in want_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key
    for name, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, atol=ATOL, rtol=0, msg=lambda msg, n=name: f"{n}: {msg}")
    model.eval()


def test_unsupported_model_falls_back_to_hf_and_picks_the_positions() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32)).eval()
    assert fast_path_unsupported(model) is not None
    ids, lens, select = grpo_batch()
    full = _pad_select(select)
    with torch.no_grad():
        got = selected_hidden_states(model, ids, lens, full)
        want = hf_hidden_states(model, ids, lens)[full]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="fast=True"):
        selected_hidden_states(model, ids, lens, full, fast=True)


def test_attention_rows_of_a_shared_prefix_read_one_copy() -> None:
    """Rows repeating a prompt read the same packed tokens for it: the prompt is computed once."""
    ids, lens, select = grpo_batch()
    pk = SharedPacking(ids, lens, _pad_select(select))
    slots = pk.slot.view(pk.batch, pk.seq)  # [B, S'] packed token of each row position
    assert torch.equal(slots[1, :5], slots[0, :5]) and torch.equal(slots[2, :7], slots[1, :7])
    assert not torch.equal(slots[2, :8], slots[1, :8])  # they part after the shared generated tokens
    assert torch.equal(slots[8], slots[6])  # an exact duplicate row is computed once

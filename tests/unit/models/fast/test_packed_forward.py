"""Packed forward (sequence packing): a bin of sequences runs as one token stream whose sequences attend only to
themselves, positions restarting at 0, on the fast path (`RowGroups`) and on HF's (one packed row, block-diagonal
mask). Every sequence's hidden states and gradients equal those of the sequence run on its own.

Tolerance (float32 rounding, tests.helpers.f32_tol): both sides evaluate the same expression with other groupings
(GEMM blocking over another token count, attention over another padded width). The longest sum behind a hidden
state is an MLP projection over the intermediate size or an attention average over at most S keys, so a hidden
state may move by f32_tol(max|h|, max(intermediate, S)) per layer; with L layers the perturbations add up at most L
times. At these sizes (|h| <= 5, n <= 512, L = 2) that is at most 6.8e-5; measured differences are at most 1.3e-6.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from relayrl.models.fast.forward import backbone_hidden_states, hf_hidden_states, selected_hidden_states
from relayrl.models.fast.packing import GROUP_CALL_PAIRS, PaddedPacking, RowGroups
from relayrl.models.fast.support import fast_path_unsupported
from tests.helpers import f32_tol
from tests.unit.models.fast.builders import SHAPE, VOCAB, llama_gqa, mistral, qwen2_bench, qwen3, randomize

LENGTHS = [60, 3, 41, 1, 0, 64, 9, 17]  # skewed, one empty row (treated as length 1, as the unpacked path does)
SEQ = 64


def gpt2() -> PreTrainedModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, attn_implementation="eager")
    return randomize(GPT2LMHeadModel(config))


MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "qwen2": qwen2_bench,
    "llama-gqa": llama_gqa,
    "qwen3": qwen3,
    "mistral": mistral,
    "gpt2-hf": gpt2,  # not a fast-path model: HF's forward on one packed row
}


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(LENGTHS)
    real = torch.arange(SEQ)[None, :] < lens.clamp(min=1)[:, None]  # [B, S]
    ids = torch.randint(2, VOCAB, (len(LENGTHS), SEQ), generator=g).masked_fill(~real, 0)  # [B, S]
    ids[2, :30] = ids[0, :30]  # a shared prefix (GRPO's generations of one prompt)
    return ids, lens, real


def alone(model: PreTrainedModel, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Each row run as a batch of its own, cut to its length: [B, S, H] (zeros past each row's end)."""
    out = []
    for b in range(ids.shape[0]):
        n = max(int(lens[b]), 1)
        h = backbone_hidden_states(model, ids[b : b + 1, :n], lens[b : b + 1])[0]  # [n, H]
        out.append(torch.cat([h, h.new_zeros(SEQ - n, h.shape[-1])]))
    return torch.stack(out)


def tolerance(model: PreTrainedModel, scale: float) -> float:
    config = model.config
    layers = int(getattr(config, "num_hidden_layers", 0) or config.n_layer)
    width = max(int(getattr(config, "intermediate_size", 0) or 4 * SHAPE["hidden_size"]), SEQ)
    return layers * f32_tol(scale, width)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_rows_equal_each_sequence_run_alone(name: str) -> None:
    model = MODELS[name]()
    assert (fast_path_unsupported(model) is None) == (name != "gpt2-hf")
    ids, lens, real = batch()
    with torch.no_grad():
        want = alone(model, ids, lens)
        tol = tolerance(model, float(want.abs().max()))
        assert tol < 1e-4
        for fast in [None, False] if name != "gpt2-hf" else [None]:
            got = backbone_hidden_states(model, ids, lens, fast=fast, packed=True)  # [B, S, H]
            assert (got[real] - want[real]).abs().max() <= tol
            assert got[~real].abs().max() == 0  # padding comes back as zeros
            cols = torch.arange(SEQ)[None, :]
            select = (cols < lens[:, None]) & (cols % 3 != 1)  # [B, S] some positions of every non-empty row
            picked = selected_hidden_states(model, ids, lens, select, fast=fast, packed=True)  # [M, H]
            assert (picked - want[select]).abs().max() <= tol


@pytest.mark.parametrize("fast", [None, False])
def test_sequences_in_a_bin_never_see_each_other(fast: bool | None) -> None:
    """Changing every other sequence's tokens leaves a sequence's hidden states bit for bit the same."""
    model = qwen2_bench()
    ids, lens, real = batch()
    other = batch(seed=7)[0]
    with torch.no_grad():
        base = backbone_hidden_states(model, ids, lens, fast=fast, packed=True)
        for row in range(len(LENGTHS)):
            mixed = other.clone()
            mixed[row] = ids[row]
            got = backbone_hidden_states(model, mixed, lens, fast=fast, packed=True)
            assert torch.equal(got[row], base[row]), row


def test_positions_restart_for_every_sequence() -> None:
    """A sequence's result does not depend on where in the bin it sits (its positions start at 0 wherever)."""
    model = qwen2_bench()
    ids, lens, real = batch()
    order = torch.tensor([5, 3, 0, 7, 1, 6, 4, 2])
    with torch.no_grad():
        base = backbone_hidden_states(model, ids, lens, packed=True)
        for fast in (None, False):
            moved = backbone_hidden_states(model, ids[order], lens[order], fast=fast, packed=True)
            tol = tolerance(model, float(base.abs().max()))
            assert (moved[real[order]] - base[order][real[order]]).abs().max() <= tol


def test_gradients_equal_the_unpacked_ones() -> None:
    ids, lens, real = batch()
    grads = {}
    for packed in (False, True):
        model = qwen2_bench().train()
        select = real & (torch.arange(SEQ)[None, :] >= 2)
        hidden = selected_hidden_states(model, ids, lens, select, packed=packed)  # [M, H]
        hidden.square().mean().backward()
        grads[packed] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 10
    for name, g in grads[False].items():
        # a parameter's gradient sums one term per selected token: f32_tol over the tokens, at the gradient's scale
        assert (grads[True][name] - g).abs().max() <= f32_tol(float(g.abs().max()), int(select.sum())) + 1e-12, name


def test_row_groups_pad_only_where_a_call_would_cost_more() -> None:
    lens = torch.tensor([700, 3, 698, 0, 2, 90, 70])  # the empty row counts as one token
    pk = PaddedPacking(lens, len(lens), 700, torch.device("cpu"))
    groups = pk.row_groups()
    widths = [(rows, width) for _, rows, width in groups.parts]
    assert widths == [(2, 700), (2, 90), (3, 3)]  # 90^2 - 70^2 < 64^2 <= 90^2 - 3^2
    assert groups.pack_index.shape[0] == pk.num_tokens == 700 + 3 + 698 + 1 + 2 + 90 + 70
    assert groups.pack_index.unique().shape == groups.pack_index.shape  # one grouped slot per token
    assert GROUP_CALL_PAIRS == 64 * 64
    empty = RowGroups(torch.zeros(2, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.zeros(0).long(), 2)
    assert empty.parts == []


def test_hf_packed_row_matches_hf_per_row() -> None:
    """HF's forward on the packed row agrees with HF's own padded forward at every real position."""
    model = gpt2()
    ids, lens, real = batch()
    with torch.no_grad():
        packed = hf_hidden_states(model, ids, lens, packed=True)
        padded = hf_hidden_states(model, ids, lens)
    assert (packed[real] - padded[real]).abs().max() <= tolerance(model, float(padded[real].abs().max()))

"""Chunked log-softmax and sampler-compatible filtering, checked against direct full-vocabulary computations."""

from __future__ import annotations

import pytest
import torch

from relayrl.models.generation.sampling import SUPPORT_OVERFLOW
from relayrl.models.policy import logprobs as lp_ops

B, S, H, V = 3, 9, 16, 40


@pytest.fixture()
def setup() -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, H, generator=g)  # [B, S, H]
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    ids = torch.randint(0, V, (B, S), generator=g)  # [B, S]
    return hidden, head, ids


def direct_logprobs(hidden: torch.Tensor, head: torch.nn.Module, ids: torch.Tensor, temp: float) -> torch.Tensor:
    logits = head(hidden)[:, :-1].float() / temp  # [B, S-1, V]
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, S-1]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, S - 1, 100, None])
def test_chunked_equals_unchunked(setup, chunk) -> None:
    hidden, head, ids = setup
    got, _ = lp_ops.next_token_logprobs(hidden, head, ids, temperature=0.7, chunk_size=chunk)
    want = direct_logprobs(hidden, head, ids, 0.7)
    assert got.shape == (B, S - 1) and got.dtype == torch.float32
    # Different chunk widths may pick different matmul kernels: equal up to float32 rounding of logits ~10.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4])
def test_chunked_gradients_equal_unchunked(setup, chunk) -> None:
    """Recomputed (checkpointed) chunks give the same gradients as one full-vocabulary pass."""
    hidden, head, ids = setup
    weights = torch.randn(B, S - 1, generator=torch.Generator().manual_seed(1))
    h1 = hidden.clone().requires_grad_(True)
    got, _ = lp_ops.next_token_logprobs(h1, head, ids, chunk_size=chunk)
    (got * weights).sum().backward()
    g_chunk, w_chunk = h1.grad.clone(), head.weight.grad.clone()
    head.weight.grad = None
    h2 = hidden.clone().requires_grad_(True)
    (direct_logprobs(h2, head, ids, 1.0) * weights).sum().backward()
    torch.testing.assert_close(g_chunk, h2.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w_chunk, head.weight.grad, atol=1e-5, rtol=0)


def brute_force_keep(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Per row: keep the k largest, then keep a token iff the renormalised mass of strictly likelier tokens < p."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    for r in range(logits.shape[0]):
        row = logits[r]
        if top_k is not None:
            kth = row.sort(descending=True).values[top_k - 1]
            keep[r] &= row >= kth
        probs = torch.where(keep[r], row, torch.tensor(float("-inf"))).softmax(-1)
        for j in range(row.numel()):
            if keep[r, j]:
                above = probs[(row > row[j]) & keep[r]].sum()
                keep[r, j] = bool(above < top_p) if top_p < 1 else True
    return keep


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (None, 0.5), (5, 0.8), (1, 0.3), (None, 0.999)])
def test_top_k_top_p_matches_brute_force(top_k, top_p) -> None:
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(2))
    dropped = lp_ops.top_k_top_p_mask(logits, top_k, top_p)
    assert torch.equal(~dropped, brute_force_keep(logits, top_k, top_p))
    assert (~dropped).sum(-1).min() >= 1  # the most likely token always survives


def test_top_k_keeps_ties_and_small_example() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 3.0, 0.0]])
    kept = ~lp_ops.top_k_top_p_mask(logits, top_k=2, top_p=1.0)
    assert kept.tolist() == [[False, False, True, True, False]]
    # probs of [0, 0, ln 3] ~ [0.2, 0.2, 0.6]: top_p=0.5 keeps only the 0.6 token, 0.7 keeps it plus one 0.2
    logits = torch.tensor([[0.0, 0.0, float(torch.log(torch.tensor(3.0)))]])
    assert (~lp_ops.top_k_top_p_mask(logits, None, 0.5)).sum() == 1
    assert (~lp_ops.top_k_top_p_mask(logits, None, 0.7)).sum() == 2


def test_filtered_logprobs_renormalise_and_mark_dropped_targets(setup) -> None:
    hidden, head, ids = setup
    got, plain = lp_ops.next_token_logprobs(hidden, head, ids, top_k=4, chunk_size=3, return_unfiltered=True)
    logits = head(hidden)[:, :-1]  # [B, S-1, V]
    filtered = lp_ops.apply_top_k_top_p(logits, 4, 1.0)
    want = filtered.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(plain, direct_logprobs(hidden, head, ids, 1.0), atol=1e-6, rtol=0)
    in_top4 = (logits.topk(4, dim=-1).indices == ids[:, 1:, None]).any(-1)  # [B, S-1]
    assert torch.equal(torch.isfinite(got), in_top4)
    cleaned = lp_ops.zero_invalid(got)
    assert torch.isfinite(cleaned).all() and torch.equal(cleaned[~in_top4], torch.zeros(int((~in_top4).sum())))


def test_unfiltered_copy_is_the_same_tensor_when_no_filtering(setup) -> None:
    hidden, head, ids = setup
    got, plain = lp_ops.next_token_logprobs(hidden, head, ids, return_unfiltered=True)
    assert plain is got


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_topk_logits_match_torch_topk(setup, chunk) -> None:
    hidden, head, ids = setup
    vals, idx = lp_ops.topk_logits(hidden, head, 5, temperature=0.5, chunk_size=chunk)
    want = (head(hidden)[:, :-1] / 0.5).topk(5, dim=-1)
    assert vals.shape == idx.shape == (B, S - 1, 5) and idx.dtype == torch.int64
    torch.testing.assert_close(vals, want.values, atol=1e-5, rtol=1e-6)
    assert torch.equal(idx, want.indices)
    with pytest.raises(ValueError, match="k must be in"):
        lp_ops.topk_logits(hidden, head, V + 1)


def test_token_aligned_prepends_zero_and_masks_padding() -> None:
    nxt = torch.arange(1.0, 13.0).view(3, 4)  # [3, S-1=4]
    out = lp_ops.token_aligned(nxt, torch.tensor([5, 2, 0]))
    assert out.tolist() == [[0, 1, 2, 3, 4], [0, 5, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_auto_chunk_size_respects_budget() -> None:
    assert lp_ops.auto_chunk_size(rows=4, vocab_size=1000, budget_bytes=4 * 1000 * 4 * 7) == 7
    assert lp_ops.auto_chunk_size(rows=4096, vocab_size=150_000) == 1
    assert not lp_ops.filtering_active(None, 1.0) and lp_ops.filtering_active(3, 1.0)


def test_the_head_s_chunk_budget_comes_from_the_gpu_s_free_memory_once_and_stays(monkeypatch) -> None:
    """On the CPU the fixed budgets (the reference runs' chunks); on CUDA a sixteenth of the memory free at the
    first ask, a power of two in [64 MiB, 1 GiB], kept for the process even when free memory moves. The driver's
    free-memory query is the one thing stood in for here (this machine has no GPU; the gpu-marked run asks it)."""
    cpu = torch.device("cpu")
    assert lp_ops.chunk_budget_bytes(cpu) == lp_ops.DEFAULT_CHUNK_BUDGET_BYTES == 64 * 2**20
    assert lp_ops.chunk_budget_bytes(cpu, packed=True) == lp_ops.PACKED_CHUNK_BUDGET_BYTES
    free = {"cuda:0": 100 * 2**30, "cuda:1": 3 * 2**30, "cuda:2": 2**29}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[str(d)], 141 * 2**30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(lp_ops, "_device_budgets", {})
    assert lp_ops.chunk_budget_bytes(torch.device("cuda:0")) == 2**30  # 6.25 GiB share, capped at 1 GiB
    assert lp_ops.chunk_budget_bytes(torch.device("cuda")) == 128 * 2**20  # 192 MiB -> 128 MiB, current device 1
    assert lp_ops.chunk_budget_bytes(torch.device("cuda:2"), packed=True) == 64 * 2**20  # 32 MiB share -> the floor
    free["cuda:1"] = 2**20  # memory taken later does not change the run's chunks
    assert lp_ops.chunk_budget_bytes(torch.device("cuda:1")) == 128 * 2**20
    # a Qwen2.5 vocabulary: 8 rows take 13 positions a chunk under the CPU budget, 220 under a 1 GiB one
    assert lp_ops.auto_chunk_size(8, 151_936, lp_ops.chunk_budget_bytes(cpu)) == 13
    assert lp_ops.auto_chunk_size(8, 151_936, lp_ops.chunk_budget_bytes(torch.device("cuda:0"))) == 220


def test_recorded_support_replaces_the_filter_only_where_recorded(setup) -> None:
    """Positions with a record mask to it (and count a mismatch where the recomputed filter differs); an overflow
    marker or an empty record falls back to the filter recomputed from these logits."""
    hidden, head, ids = setup
    h, tgt = hidden.reshape(B * S, H)[:4], ids.reshape(-1)[:4]  # [4, H], [4]
    logits = head(h).float()  # [4, V]
    top3 = logits.topk(3, dim=-1).indices  # [4, 3]
    support = torch.zeros(4, 6, dtype=torch.int32)  # [4, K]
    support[0, :3] = top3[0] + 1  # the same set the filter keeps: no mismatch
    support[1, :2] = torch.stack([tgt[1], (tgt[1] + 1) % V]) + 1  # another set, holding the target
    support[2, 0] = SUPPORT_OVERFLOW  # row 3 stays all zeros: nothing recorded
    mismatch: list[torch.Tensor] = []
    got, _ = lp_ops.selected_logprobs(h, head, tgt, top_k=3, support=support, mismatch_out=mismatch)
    own = lp_ops.apply_top_k_top_p(logits, 3, 1.0).log_softmax(-1).gather(-1, tgt[:, None])[:, 0]  # [4]
    pair = logits[1, [tgt[1], (tgt[1] + 1) % V]]
    torch.testing.assert_close(got[[0, 2, 3]], own[[0, 2, 3]], atol=0, rtol=0)
    torch.testing.assert_close(got[1], pair.log_softmax(-1)[0], atol=1e-6, rtol=0)
    assert torch.cat(mismatch).tolist() == [False, True, False, False]

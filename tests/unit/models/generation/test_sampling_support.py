"""The sampler's kept-set record (`sampling.support_record` / `support_mask`) and its journey through a generate()
call: exact sets for top-k (ties included) and top-p, an overflow marker when a set is wider than the record."""

from __future__ import annotations

import torch

from relayrl.models.generation.sampling import (
    SUPPORT_OVERFLOW,
    TokenSampler,
    apply_top_k_top_p,
    support_mask,
    support_record,
)


def test_record_round_trips_the_kept_set_exactly() -> None:
    logits = 3 * torch.randn(64, 50, generator=torch.Generator().manual_seed(0))  # [B, V], peaked: small top-p sets
    logits[0, :6] = 9.0  # a tie across the top-k boundary: all six are kept
    for top_k, top_p in [(4, 1.0), (None, 0.6), (10, 0.8), (1, 1.0)]:
        filtered = apply_top_k_top_p(logits, top_k, top_p)  # [B, V]
        kept, recorded = support_mask(support_record(filtered, 16), 50)  # [B, V], [B]
        assert recorded.all() and torch.equal(kept, torch.isfinite(filtered)), (top_k, top_p)
    assert int(torch.isfinite(apply_top_k_top_p(logits, 4, 1.0))[0].sum()) == 6


def test_a_set_wider_than_the_record_is_marked_not_recorded() -> None:
    logits = torch.zeros(2, 40)  # [B, V]
    logits[1, 0] = 10.0  # row 1: one token holds nearly all the mass; row 0: uniform, top-p keeps 36 of 40
    record = support_record(apply_top_k_top_p(logits, None, 0.9), 8)  # [B, 8]
    assert record[0].tolist() == [SUPPORT_OVERFLOW] + [0] * 7
    assert record[1].tolist() == [1] + [0] * 7  # token 0, stored as id + 1
    kept, recorded = support_mask(record, 40)
    assert recorded.tolist() == [False, True] and not kept[0].any() and kept[1].nonzero().flatten().tolist() == [0]
    assert support_mask(torch.zeros(3, 8, dtype=torch.int32), 40)[1].tolist() == [False] * 3  # padding: no record


def test_sampler_records_only_when_it_filters() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 30, generator=g)  # [B, V]
    plain = TokenSampler(generator=g, record_support=8)
    plain(logits)
    assert plain.record_support == 0 and plain.last_support is None  # nothing to record without a filter
    assert TokenSampler(top_k=3, greedy=True, record_support=8).record_support == 0
    filtering = TokenSampler(top_k=3, generator=g, record_support=8)
    tokens, _ = filtering(logits)
    record = filtering.last_support
    assert record is not None and record.shape == (5, 8) and record.dtype == torch.int32
    kept, _ = support_mask(record, 30)
    assert torch.equal(kept, torch.isfinite(apply_top_k_top_p(logits, 3, 1.0)))
    assert kept.gather(1, tokens[:, None]).all()  # every sampled token is in its recorded set

"""The carry's wire form is exact (same values, same dtypes) and small."""

from __future__ import annotations

import pytest
import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.carry_wire import compact_tensor, decode_carry, encode_carry, wire_nbytes


def _carry(p: int, g: int, seed: int = 0) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(seed)
    b = p * g
    prompt_hash = torch.randint(-(2**62), 2**62, (p,), generator=gen).repeat_interleave(g)  # [B] int64
    return BatchedDataDict(
        total_reward=torch.randint(0, 2, (b,), generator=gen).float(),  # binary rewards
        loss_multiplier=torch.ones(b),
        truncated=torch.rand(b, generator=gen) < 0.3,
        length=torch.randint(5, 40, (p,), generator=gen).repeat_interleave(g),  # [B] prompt tokens
        prompt_group=prompt_hash,
        loss_token_counts=torch.randint(1, 200, (b,), generator=gen),
        sample_text=[("p", "c") if i < 3 else None for i in range(b)],
    )


def _assert_same(a: BatchedDataDict, b: BatchedDataDict) -> None:
    assert list(a) == list(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("p,g", [(16, 8), (3, 1), (5, 4)])
def test_round_trip_is_exact(p: int, g: int) -> None:
    carry = _carry(p, g, seed=p + g)
    _assert_same(decode_carry(encode_carry(carry, g)), carry)


def test_wire_layout_and_size_for_the_default_step() -> None:
    """16 prompts x 8 generations: 3 flags in one byte/row, group-constant columns once per prompt, uint8 counts."""
    carry = _carry(16, 8)
    wire = encode_carry(carry, 8)
    assert wire["bits"] == ["total_reward", "loss_multiplier", "truncated"]
    assert set(wire["per_prompt"]) == {"length", "prompt_group"}
    assert wire["per_row"]["loss_token_counts"].dtype == torch.uint8
    text = 3 * 2  # three rows of ("p", "c")
    assert wire_nbytes(wire) == 128 + 16 * 1 + 16 * 8 + 128 + text
    plain = sum(v.numel() * v.element_size() for v in carry.values() if isinstance(v, torch.Tensor))
    assert plain == 128 * (4 + 4 + 1 + 8 + 8 + 8) and wire_nbytes(wire) < plain / 9


def test_non_binary_and_non_constant_columns_travel_per_row() -> None:
    carry = BatchedDataDict(
        total_reward=torch.tensor([0.5, 1.0, 0.0, 0.25]),  # fractional: stays float32 per row
        length=torch.tensor([3, 4, 5, 5]),  # differs inside the first group
        big=torch.tensor([0, 70000, 1, 2]),
    )
    wire = encode_carry(carry, 2)
    assert wire["bits"] == [] and wire["flags"] is None
    assert wire["per_row"]["total_reward"].dtype == torch.float32
    assert wire["per_row"]["length"].dtype == torch.uint8 and wire["per_row"]["big"].dtype == torch.int32
    _assert_same(decode_carry(wire), carry)


def test_more_than_eight_binary_columns_keep_the_rest_per_row() -> None:
    carry = BatchedDataDict({f"f{i}": torch.tensor([i % 2 == 0, True, False, True]) for i in range(10)})
    wire = encode_carry(carry, 1)
    assert len(wire["bits"]) == 8 and {"f8", "f9"} <= set(wire["per_row"])
    _assert_same(decode_carry(wire), carry)


def test_rows_must_fill_whole_groups() -> None:
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        encode_carry(BatchedDataDict(x=torch.zeros(6)), 4)


def test_compact_tensor_is_exact_and_smaller() -> None:
    ints = torch.tensor([0, 5, 30000], dtype=torch.int64)
    assert compact_tensor(ints).dtype == torch.int16 and torch.equal(compact_tensor(ints).long(), ints)
    big = torch.tensor([0, 70000], dtype=torch.int64)
    assert compact_tensor(big).dtype == torch.int32 and torch.equal(compact_tensor(big).long(), big)
    binary = torch.tensor([0.0, 1.0, 1.0])
    assert compact_tensor(binary).dtype == torch.bool and torch.equal(compact_tensor(binary).float(), binary)
    frac = torch.tensor([0.5, 1.0])
    assert compact_tensor(frac) is frac

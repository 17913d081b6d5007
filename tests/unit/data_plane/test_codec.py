"""Codec: jagged packing from padded tensors and back, per-field pad values, absolute width, exact dtypes."""

from __future__ import annotations

import pytest
import torch

from relayrl.data_plane import codec
from relayrl.data_plane.codec import Column, as_column, batch_nbytes, concat_columns, flat_token_index, materialize


def test_from_padded_keeps_valid_prefixes_with_trailing_dims() -> None:
    padded = torch.arange(4 * 11 * 2).view(4, 11, 2)
    col = Column.from_padded(padded, [3, 5, 7, 4])
    assert col.values.shape == (19, 2) and col.lengths is not None and col.lengths.tolist() == [3, 5, 7, 4]
    for i, n in enumerate([3, 5, 7, 4]):
        assert torch.equal(col.row(i), padded[i, :n])


def test_from_padded_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[N, S"):
        Column.from_padded(torch.zeros(4), [1, 1, 1, 1])
    with pytest.raises(ValueError, match="3 rows"):
        Column.from_padded(torch.zeros(3, 4), [1, 2])
    with pytest.raises(ValueError, match="exceeds the padded width"):
        Column.from_padded(torch.zeros(2, 4), [5, 1])


def test_column_validation() -> None:
    with pytest.raises(ValueError, match="sum to 3"):
        Column(torch.zeros(4), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="int64"):
        Column(torch.zeros(3), torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="unsupported type"):
        as_column("message_log", [{"role": "user"}])
    with pytest.raises(ValueError, match="0-d"):
        as_column("x", torch.tensor(1.0))


def test_materialize_per_field_pad_and_default_zero() -> None:
    ids = Column.from_rows([torch.tensor([10, 20, 30]), torch.tensor([40, 50]), torch.tensor([60, 70, 80, 90])])
    mask = Column(torch.ones(9, dtype=torch.bool), ids.lengths)
    out = materialize(
        {"input_ids": ids, "token_mask": mask, "reward": torch.tensor([1.0, 2.0, 3.0])}, {"input_ids": 999}
    )
    assert out["input_ids"].tolist() == [[10, 20, 30, 999], [40, 50, 999, 999], [60, 70, 80, 90]]
    assert out["token_mask"].tolist() == [[True, True, True, False], [True, True, False, False], [True] * 4]
    assert out["reward"].tolist() == [1.0, 2.0, 3.0]


def test_materialize_absolute_width_never_truncates() -> None:
    col = Column.jagged(torch.arange(5), [2, 3])
    assert materialize({"x": col}, pad_to_seqlen=6)["x"].tolist() == [[0, 1, 0, 0, 0, 0], [2, 3, 4, 0, 0, 0]]
    dense = torch.ones(2, 3)
    assert materialize({"grid": dense}, pad_to_seqlen=6)["grid"].shape == (2, 3)  # dense fields untouched
    with pytest.raises(ValueError, match="does not fit pad_to_seqlen=2"):
        col.materialize(pad_to_seqlen=2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16])
def test_dtypes_round_trip_exactly(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    padded = (torch.randn(6, 9, generator=g) * 1000).to(dtype)
    lens = torch.randint(0, 10, (6,), generator=g)
    col = Column.from_padded(padded, lens)
    back = col.materialize(pad_to_seqlen=9)
    assert back.dtype == dtype
    keep = torch.arange(9) < lens.unsqueeze(1)
    assert torch.equal(back[keep], padded[keep])
    assert not back[~keep].any()


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "index-copy-fallback"])
def test_both_materialize_paths_agree(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not fused:
        monkeypatch.setattr(codec, "_JAGGED_TO_PADDED", None)
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([0, 3, 1, 5])
    values = torch.randint(-50, 50, (9, 2, 3), generator=g)
    out = Column(values, lens).materialize(pad_value=-99, pad_to_seqlen=6)
    assert out.shape == (4, 6, 2, 3) and out.dtype == torch.int64
    at = 0
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(out[i, :n], values[at : at + n]) and bool((out[i, n:] == -99).all())
        at += n
    empty = Column(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)).materialize(pad_to_seqlen=4)
    assert empty.shape == (0, 4, 2)
    big_pad = Column.jagged(torch.tensor([1, 2, 3]), [1, 2]).materialize(pad_value=2**60)
    assert big_pad.tolist() == [[1, 2**60], [2, 3]]


def test_nested_round_trip_and_concat() -> None:
    col = Column.jagged(torch.arange(6.0), [1, 2, 3])
    nested = col.to_nested()
    back = Column.from_nested(nested)
    assert torch.equal(back.values, col.values) and back.lengths is not None and back.lengths.tolist() == [1, 2, 3]
    assert as_column("x", nested).is_jagged
    both = concat_columns([col, Column.jagged(torch.tensor([9.0]), [1])])
    assert both.num_rows == 4 and both.row(3).tolist() == [9.0]
    with pytest.raises(ValueError, match="differ"):
        concat_columns([col, Column(torch.zeros(2))])


def test_flat_token_index_matches_ranges() -> None:
    starts, lens = torch.tensor([5, 0, 9, 3]), torch.tensor([2, 0, 3, 1])
    assert flat_token_index(starts, lens).tolist() == [5, 6, 9, 10, 11, 3]
    assert flat_token_index(torch.tensor([4]), torch.tensor([0])).tolist() == []


def test_batch_nbytes_counts_payload() -> None:
    col = Column.jagged(torch.zeros(10, dtype=torch.float32), [4, 6])
    assert batch_nbytes({"a": col, "b": torch.zeros(3, dtype=torch.int64)}) == 40 + 16 + 24

"""Row checksums (checksum.py): per row, independent of how rows are packed, sensitive to every kind of change the
data plane could suffer, equal on the numpy (CPU) and torch (device) paths, and verified with one line per fault."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relayrl.data_plane import checksum as cs
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import ChecksumMismatchError
from relayrl.data_plane.proxy import verify_rows

g = torch.Generator().manual_seed(0)
LENS = torch.tensor([3, 0, 5, 1, 4])
T = int(LENS.sum())
COLUMNS = {
    "int64": Column(torch.randint(-(2**62), 2**62, (T,), generator=g), LENS),
    "int32 [T, 3]": Column(torch.randint(-9, 9, (T, 3), generator=g, dtype=torch.int32), LENS),
    "bool": Column(torch.rand(T, generator=g) > 0.5, LENS),
    "float32": Column(torch.randn(T, generator=g), LENS),
    "bfloat16": Column(torch.randn(T, generator=g).bfloat16(), LENS),
    "uint8 [T, 3]": Column(torch.randint(0, 255, (T, 3), generator=g, dtype=torch.uint8), LENS),
    "dense float32": Column(torch.randn(5, generator=g)),
    "dense int64 [N, 2, 3]": Column(torch.randint(-9, 9, (5, 2, 3), generator=g)),
}


@pytest.mark.parametrize("name", list(COLUMNS))
def test_digest_is_per_row_whatever_the_packing(name: str) -> None:
    col = COLUMNS[name]
    d = cs.row_digests(col)  # [N]
    assert d.dtype == torch.int64 and d.shape == (col.num_rows,) and bool((d >= 0).all())
    order = [4, 2, 2, 0, 3, 1]
    if col.is_jagged:
        again = Column.from_rows([col.row(i) for i in order]) if any(LENS[order]) else None
        assert again is not None and torch.equal(cs.row_digests(again), d[order])
    else:
        assert torch.equal(cs.row_digests(Column(col.values[order])), d[order])
    words = cs._words(col.values)
    assert torch.equal(torch.from_numpy(cs._digests_torch(words, col.lengths).numpy()), d)  # the device path


@pytest.mark.parametrize("name", list(COLUMNS))
def test_every_single_bit_flip_is_seen(name: str) -> None:
    col = COLUMNS[name]
    d = cs.row_digests(col)
    raw = col.values.reshape(-1).view(torch.uint8)  # every byte of the column
    for byte in range(raw.shape[0]):
        for bit in (0, 7):
            raw[byte] ^= 1 << bit
            changed = cs.row_digests(col)
            raw[byte] ^= 1 << bit
            assert int((changed != d).sum()) == 1, (byte, bit)
    assert torch.equal(cs.row_digests(col), d)


def test_swaps_zeroed_constant_rows_and_lengths_are_seen() -> None:
    ids = Column(torch.tensor([1, 2, 3, 7, 7, 7, 7]), torch.tensor([3, 4]))
    d = cs.row_digests(ids)
    assert cs.row_digests(Column(torch.tensor([2, 1, 3, 7, 7, 7, 7]), torch.tensor([3, 4])))[0] != d[0]
    assert cs.row_digests(Column(torch.tensor([1, 2, 3, 0, 0, 0, 0]), torch.tensor([3, 4])))[1] != d[1]
    assert cs.row_digests(Column(torch.tensor([1, 2, 3, 7, 7, 7, 7]), torch.tensor([4, 3])))[0] != d[0]
    adv = Column(torch.full((2, 4), 0.5))  # a constant-valued dense row (advantages)
    assert cs.row_digests(Column(torch.zeros(2, 4)))[0] != cs.row_digests(adv)[0]


def test_int64_sign_bit_flip_survives_the_63_bit_fold() -> None:
    x = torch.tensor([5, -(2**63) + 5])  # differ only in the sign bit
    a, b = cs.row_digests(Column(x[:1])), cs.row_digests(Column(x[1:]))
    assert a != b


def test_verify_names_key_and_field_in_one_line_and_counts_unchecked_rows() -> None:
    col = COLUMNS["float32"]
    stored = {"lp": cs.row_digests(col)}
    keys = [f"k{i}" for i in range(5)]
    assert verify_rows({"lp": col}, stored, keys, "train") == 0
    none = {"lp": torch.tensor([cs.NO_CHECKSUM] * 5)}
    assert verify_rows({"lp": col}, none, keys, "train") == 5
    bad = stored["lp"].clone()
    bad[[2, 4]] += 1
    with pytest.raises(ChecksumMismatchError) as e:
        verify_rows({"lp": col}, {"lp": bad}, keys, "train")
    msg = str(e.value)
    assert "\n" not in msg and "'k2'" in msg and "'lp'" in msg and "'train'" in msg and "2 rows" in msg
    assert (e.value.key, e.value.field) == ("k2", "lp")


def test_empty_columns() -> None:
    assert cs.row_digests(Column(torch.zeros(0))).shape == (0,)
    empty_rows = cs.row_digests(Column(torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)))
    assert np.array_equal(empty_rows.numpy(), np.zeros(3, dtype=np.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(COLUMNS))
def test_digest_on_the_gpu_equals_the_cpu_one(name: str) -> None:
    """A GPU column is digested where it lives (torch path); the digests equal the CPU (numpy) path's."""
    col = COLUMNS[name]
    on_gpu = Column(col.values.cuda(), None if col.lengths is None else col.lengths.cuda())
    assert torch.equal(cs.row_digests(on_gpu), cs.row_digests(col))

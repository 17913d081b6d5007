"""Refit digests: exact, position-sensitive, dtype-aware, and the same however the tensor is laid out or chunked."""

from __future__ import annotations

import logging

import pytest
import torch

from relayrl.distributed import refit_digest as rd


def test_equal_values_equal_digests_and_any_change_moves_one():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(97, 64, generator=g)  # [R, C]
    assert rd.tensor_digest(a) == rd.tensor_digest(a.clone())
    assert rd.tensor_digest(a) == rd.tensor_digest(a.t().contiguous().t())  # strides do not matter, values do
    one_ulp = a.clone()
    one_ulp[50, 3] = torch.nextafter(a[50, 3], torch.tensor(float("inf")))
    assert rd.tensor_digest(one_ulp) != rd.tensor_digest(a)
    swapped = a.clone()  # float32 elements 0 and 2 lie in two different 64-bit words
    swapped[0, 0], swapped[0, 2] = a[0, 2], a[0, 0]
    assert rd.tensor_digest(swapped)[1] == rd.tensor_digest(a)[1]  # the plain sum cannot see a swap of words ...
    assert rd.tensor_digest(swapped) != rd.tensor_digest(a)  # ... the position-weighted one does
    assert rd.tensor_digest(a.t().contiguous()) != rd.tensor_digest(a)  # a transposed copy is another tensor


def test_a_lossy_cast_and_the_dtype_are_seen():
    a = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    through_bf16 = a.to(torch.bfloat16).to(torch.float32)
    assert rd.tensor_digest(through_bf16) != rd.tensor_digest(a)
    assert rd.tensor_digest(a.to(torch.bfloat16))[0] == "bfloat16"
    assert rd.tensor_digest(through_bf16.to(torch.bfloat16)) == rd.tensor_digest(a.to(torch.bfloat16))  # exact cast


def test_chunks_are_position_weighted_too():
    n = rd._CHUNK + 1000  # two chunks of 64-bit words
    a = torch.arange(n, dtype=torch.int64)  # [N]: one word each
    b = a.clone()
    b[5], b[rd._CHUNK + 5] = a[rd._CHUNK + 5], a[5]  # the same weight inside each chunk: only the chunk index differs
    assert rd.tensor_digest(b) != rd.tensor_digest(a)
    assert rd.digest_all([("a", a), ("e", torch.zeros(0))]) == {"a": rd.tensor_digest(a), "e": ("float32", 0, 0)}


def test_a_tensor_is_read_as_64_bit_words_whatever_its_length_or_offset():
    """Words are views of the raw bytes (no per-element conversion); a ragged tail is zero-padded and a slice that
    starts off a word boundary is copied first, so its digest is its values', not its position's in the buffer."""
    a = torch.arange(7, dtype=torch.int16)  # 14 bytes: one word and a padded one
    assert rd._words(a).tolist() == [0x0003_0002_0001_0000, 0x0000_0006_0005_0004]
    buffer = torch.randn(1001)  # [N]
    inside = buffer[1:1000]  # a view 4 bytes into its storage
    assert inside.storage_offset() == 1 and rd.tensor_digest(inside) == rd.tensor_digest(inside.clone())
    aligned = buffer[2:1000]
    assert rd._words(aligned).data_ptr() == aligned.data_ptr()  # on a word boundary: read in place


def test_expected_digests_cast_where_the_key_names_a_dtype():
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    keys = ["w", "w@bfloat16", "w@bfloat16/compute", "gone", "kv_scales/layer0.k"]
    got = rd.expected_digests([("w", w)], keys)
    assert got == {
        "w": rd.tensor_digest(w),
        "w@bfloat16": rd.tensor_digest(w.to(torch.bfloat16)),
        "w@bfloat16/compute": rd.tensor_digest(w.to(torch.bfloat16)),
    }
    assert rd.compare(got, {**got, "gone": ("float32", 1, 2)}) == ["gone"]  # nothing on the trainer's side to match
    assert rd.scale_digests({"a": 0.5}) == rd.scale_digests({"a": 0.5}) != rd.scale_digests({"a": 0.5000001})


def test_check_names_the_tensor_the_worker_and_the_version(caplog: pytest.LogCaptureFixture):
    good = {"a": rd.tensor_digest(torch.ones(3)), "b": rd.tensor_digest(torch.zeros(3))}
    bad = {**good, "b": rd.tensor_digest(torch.full((3,), 2.0))}
    assert rd.check(good, [good, good], mode="enforce", where="generation", version=4, how="IPC refit") == []
    with pytest.raises(rd.RefitVerificationError) as err:
        rd.check(good, [good, bad], mode="enforce", where="generation", version=4, how="IPC refit")
    line = str(err.value)
    assert "\n" not in line
    assert "'b' on generation worker 1 is not the trainer's after the IPC refit to weights_version 4" in line
    missing = {"a": good["a"]}
    with pytest.raises(rd.RefitVerificationError, match="'b' on the engine is missing on the generation side"):
        rd.check(good, [missing], mode="enforce", where="the engine", version=1, how="sync")
    with caplog.at_level(logging.WARNING):
        assert rd.check(good, [bad], mode="log", where="the engine", version=2, how="sync") == ["b"]
    assert "refit verification failed: 'b'" in caplog.text
    assert rd.check(good, [bad], mode="off", where="the engine", version=2, how="sync") == []


def test_the_weighted_sum_is_the_same_by_dot_product_and_by_elementwise_product():
    """The CPU's integer dot and the element-wise product a CUDA device uses wrap to the same sums."""
    words = rd._words(torch.randn(3000, generator=torch.Generator().manual_seed(5)))  # [W]
    w = rd._position_weights(words.device)[: words.numel()]
    assert int(torch.dot(words, w)) == int((words * w).sum())

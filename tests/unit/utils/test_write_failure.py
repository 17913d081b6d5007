"""A failed write's reason in plain words: from the errno where the exception chain has one, else from what the write
left behind (a file cut at the size limit, a full file system), else the library's own words."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from relayrl.utils.write_failure import NEARLY_FULL_BYTES, describe_write_failure, plain_reason

TORCH_WORDS = "[enforce fail at inline_container.cc:672] . unexpected pos 194560 vs 194448"


def _left_behind(tmp_path: Path) -> Path:
    """A checkpoint's temporary directory as a failed write leaves it: an older complete file, a newer cut one."""
    target = tmp_path / "tmp_step_4"
    (target / "policy" / "optimizer").mkdir(parents=True)
    (target / "config.yaml").write_text("x" * 100)
    cut = target / "policy" / "optimizer" / "optimizer.pt"
    cut.write_bytes(b"\0" * 4096)
    os.utime(target / "config.yaml", ns=(1, 1))  # written first
    return target


@pytest.mark.parametrize(
    ("code", "limit", "expected"),
    [
        (errno.ENOSPC, None, "no space left on device"),
        (errno.EDQUOT, None, "disk quota exceeded"),
        (errno.EROFS, None, "read-only file system"),
        (errno.EFBIG, 4096, "file size limit exceeded: the process may write files of at most 4096 bytes"),
        (errno.EFBIG, None, "file too large for the file system"),
        (errno.EIO, None, os.strerror(errno.EIO)),
    ],
)
def test_an_errno_decides_and_its_file_is_named(tmp_path, code, limit, expected):
    target = _left_behind(tmp_path)
    exc = OSError(code, os.strerror(code), str(target / "policy" / "weights" / "model.safetensors"))
    failed = plain_reason(exc, target, 10 << 30, limit)
    assert failed.reason.startswith(expected) and failed.where == target / "policy" / "weights" / "model.safetensors"
    assert failed.free_text() == "; 10240 MiB free there"


def test_an_errno_is_found_under_a_library_error(tmp_path):
    target = _left_behind(tmp_path)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError(TORCH_WORDS)  # noqa: B904 - raised during, as a library's wrapper is
    except RuntimeError as exc:
        failed = plain_reason(exc, target, 10 << 30, None)
    assert failed.reason == "no space left on device"
    assert failed.where == target / "policy" / "optimizer" / "optimizer.pt"  # the newest file: the one being written


def test_a_file_cut_at_the_size_limit_is_the_limit(tmp_path):
    target = _left_behind(tmp_path)
    failed = plain_reason(RuntimeError(TORCH_WORDS), target, 10 << 30, 4096)
    assert failed.where == target / "policy" / "optimizer" / "optimizer.pt"
    assert failed.reason.startswith("file size limit exceeded") and "4096 bytes (ulimit -f)" in failed.reason


def test_a_full_file_system_is_no_space(tmp_path):
    target = _left_behind(tmp_path)
    failed = plain_reason(RuntimeError(TORCH_WORDS), target, NEARLY_FULL_BYTES - 1, 1 << 30)
    assert failed.reason == "no space left on device" and failed.where.name == "optimizer.pt"
    assert failed.free_text() == "; 1 MiB free there"


def test_nothing_telling_keeps_the_librarys_words(tmp_path):
    target = _left_behind(tmp_path)
    failed = plain_reason(RuntimeError(TORCH_WORDS + "\nmore"), target, NEARLY_FULL_BYTES, 1 << 30)
    assert failed.reason == f"RuntimeError: {TORCH_WORDS}" and failed.where.name == "optimizer.pt"
    gone = plain_reason(RuntimeError("boom"), tmp_path / "never_made", None, None)  # the write made nothing
    assert gone.where == tmp_path / "never_made" and gone.free_text() == ""


def test_describe_reads_this_file_system_and_process(tmp_path):
    failed = describe_write_failure(RuntimeError(TORCH_WORDS), tmp_path / "tmp_step_1")
    assert failed.free_bytes is not None  # df's Avail (others write on this box meanwhile: close, not equal)
    assert abs(failed.free_bytes - shutil.disk_usage(tmp_path).free) < 1 << 30

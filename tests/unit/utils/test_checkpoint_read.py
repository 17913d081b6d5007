"""Reading a checkpoint a live run prunes meanwhile: the reader's verified hard links keep what it picked, a damaged
checkpoint is refused naming the file (or skipped for the newest intact one), and a killed reader's links go."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import CheckpointingConfig
from relayrl.utils.checkpoint import CheckpointManager
from relayrl.utils.checkpoint_read import (
    READER_PREFIX,
    published_steps,
    read_checkpoint,
    read_latest_checkpoint,
    remove_stale_readers,
)
from relayrl.utils.state_file import CheckpointError


def _save(mgr: CheckpointManager, step: int) -> Path:
    tmp = mgr.init_tmp_checkpoint(step, {"total_steps": step})
    (tmp / "weights.bin").write_bytes(bytes([step]) * 4096)
    return mgr.finalize_checkpoint(tmp)


@pytest.fixture
def mgr(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(keep_top_k=1, save_period=1), tmp_path / "ckpts")


def test_a_checkpoint_pruned_while_read_stays_readable(mgr):
    _save(mgr, 1)
    with read_latest_checkpoint(mgr.checkpoint_dir) as view:
        assert view.name == "step_1" and view != mgr.checkpoint_dir / "step_1"
        _save(mgr, 2)
        _save(mgr, 3)  # the live run prunes step_1 (and step_2) meanwhile
        assert published_steps(mgr.checkpoint_dir) == [3]
        assert (view / "weights.bin").read_bytes() == bytes([1]) * 4096
    assert not list(mgr.checkpoint_dir.glob(f"{READER_PREFIX}*"))


def test_a_damaged_checkpoint_is_refused_or_skipped_for_the_newest_intact_one(mgr, tmp_path):
    keep = CheckpointManager(CheckpointingConfig(keep_top_k=None, save_period=1), tmp_path / "all")
    _save(keep, 1)
    _save(keep, 2)
    keep.close()
    damaged = keep.checkpoint_dir / "step_2"
    (damaged / "weights.bin").write_bytes(b"\0" * 4096)
    with pytest.raises(CheckpointError, match=r"step_2 is damaged: weights.bin does not match its sha256"):
        with read_checkpoint(damaged):
            pass
    skipped: list[str] = []
    with read_latest_checkpoint(keep.checkpoint_dir, skipped) as view:
        assert view.name == "step_1"
    assert len(skipped) == 1 and "step_2 is damaged" in skipped[0]
    (keep.checkpoint_dir / "step_1" / "weights.bin").unlink()
    with pytest.raises(CheckpointError, match="holds no intact checkpoint"):
        with read_latest_checkpoint(keep.checkpoint_dir):
            pass


def test_a_killed_readers_links_are_removed_by_the_owner(mgr):
    _save(mgr, 1)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = mgr.checkpoint_dir / f"{READER_PREFIX}{gone.stdout.strip()}_x"
    live = mgr.checkpoint_dir / f"{READER_PREFIX}{os.getpid()}_y"
    stale.mkdir()
    live.mkdir()
    remove_stale_readers(mgr.checkpoint_dir)
    assert not stale.exists() and live.exists()

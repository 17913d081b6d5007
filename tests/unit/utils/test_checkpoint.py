from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from relayrl.config import CheckpointingConfig, MasterConfig
from relayrl.utils.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    GRPOSaveState,
    load_save_state,
    verify_checkpoint,
)
from tests.helpers import RunsCode


def _manager(tmp_path: Path, **cfg: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(**cfg), tmp_path / "ckpts")


def _save(mgr: CheckpointManager, step: int, info: dict[str, Any] | None = None) -> Path:
    tmp = mgr.init_tmp_checkpoint(step, info or {"total_steps": step})
    (tmp / "policy" / "weights").mkdir(parents=True)
    (tmp / "policy" / "weights" / "model.bin").write_bytes(b"w" * 16)
    return mgr.finalize_checkpoint(tmp)


def _steps(mgr: CheckpointManager) -> list[int]:
    return list(mgr.list_checkpoints())


def _listing(root: Path) -> list[str]:
    """Names in a checkpoint directory, without the owner lock file."""
    return sorted(p.name for p in root.iterdir() if p.name != ".owner.lock")


# ---------------------------------------------------------------------------------------------------- item 66
def test_init_tmp_writes_plain_json_and_config(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    info = {
        "total_steps": torch.tensor(3),
        "val:accuracy": np.float32(0.5),
        "arr": np.array([1, 2]),
        "vec": torch.tensor([0.25, 0.5]),
        "nested": {"t": torch.tensor(1.5)},
    }
    cfg = MasterConfig().model_dump()
    tmp = mgr.init_tmp_checkpoint(3, info, cfg)
    assert tmp == tmp_path / "ckpts" / "tmp_step_3" and tmp.is_dir()
    loaded = json.loads((tmp / "training_info.json").read_text())
    assert loaded == {"total_steps": 3, "val:accuracy": 0.5, "arr": [1, 2], "vec": [0.25, 0.5], "nested": {"t": 1.5}}
    config = yaml.safe_load((tmp / "config.yaml").read_text())
    assert MasterConfig.model_validate(config) == MasterConfig()  # tuples (AdamW betas) survive as lists
    assert mgr.get_latest_checkpoint_path() is None  # a tmp dir is never a checkpoint

    final = mgr.finalize_checkpoint(tmp)
    assert final == tmp_path / "ckpts" / "step_3" and not tmp.exists()
    assert mgr.load_training_info(final)["total_steps"] == 3
    assert (final / "config.yaml").is_file()
    status = json.loads((tmp_path / "ckpts" / "latest_checkpoint_status.json").read_text())
    assert status["last_checkpoint_step"] == 3 and status["last_successful_ckpt_save_completion"] > 0


def test_init_tmp_accepts_pydantic_config_and_none(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    tmp = mgr.init_tmp_checkpoint(1, {}, MasterConfig())
    assert yaml.safe_load((tmp / "config.yaml").read_text())["grpo"]["seed"] == 42
    tmp2 = mgr.init_tmp_checkpoint(2, {})
    assert not (tmp2 / "config.yaml").exists()


def test_stale_tmp_is_replaced(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    tmp = mgr.init_tmp_checkpoint(5, {"a": 1})
    (tmp / "half_written_weights").write_bytes(b"x")
    tmp = mgr.init_tmp_checkpoint(5, {"a": 2})
    assert sorted(p.name for p in tmp.iterdir()) == ["training_info.json"]
    assert mgr.load_training_info(tmp) == {"a": 2}


def test_finalize_rejects_non_tmp_dir(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    bogus = tmp_path / "ckpts" / "step_1"
    bogus.mkdir()
    with pytest.raises(ValueError, match="not a temporary checkpoint"):
        mgr.finalize_checkpoint(bogus)


def test_crash_before_finalize_keeps_previous_latest(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, keep_top_k=None)
    first = _save(mgr, 1, {"total_steps": 1})
    tmp = mgr.init_tmp_checkpoint(2, {"total_steps": 2})
    (tmp / "partial").write_bytes(b"...")  # crash here: finalize never runs
    restarted = _manager(tmp_path, keep_top_k=None)
    assert restarted.get_latest_checkpoint_path() == first
    assert restarted.load_training_info(first)["total_steps"] == 1
    second = _save(restarted, 2, {"total_steps": 2})  # a later save of the same step works
    assert restarted.get_latest_checkpoint_path() == second
    assert not (tmp_path / "ckpts" / "tmp_step_2").exists()
    assert sorted(p.name for p in second.iterdir()) == ["manifest.json", "policy", "training_info.json"]


def test_resave_same_step_swaps_atomically(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    _save(mgr, 4, {"v": "old"})
    path = _save(mgr, 4, {"v": "new"})
    assert mgr.load_training_info(path) == {"v": "new"}
    assert _listing(tmp_path / "ckpts") == ["latest_checkpoint_status.json", "step_4"]


def test_crash_mid_swap_is_recovered(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _manager(tmp_path)
    _save(mgr, 4, {"v": "old"})
    # Simulate dying between the two renames of a re-save: step_4 moved aside, replacement not yet in place.
    os.replace(root / "step_4", root / "old_step_4")
    mgr.init_tmp_checkpoint(4, {"v": "new"})
    restarted = _manager(tmp_path)
    assert restarted.get_latest_checkpoint_path() == root / "step_4"
    assert restarted.load_training_info(root / "step_4") == {"v": "old"}
    assert not (root / "old_step_4").exists()


def test_interrupted_prune_is_finished_on_restart(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _manager(tmp_path, keep_top_k=1, metric_name=None, save_period=1)
    _save(mgr, 1)
    _save(mgr, 2)
    assert _listing(root) == ["latest_checkpoint_status.json", "step_2"]
    (root / "deleting_step_1" / "policy").mkdir(parents=True)  # as if a crash hit mid-delete
    _manager(tmp_path)
    assert not (root / "deleting_step_1").exists() and (root / "step_2").is_dir()


def test_latest_ignores_other_suffixes_and_empty_dir(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, keep_top_k=None)
    assert mgr.get_latest_checkpoint_path() is None
    assert mgr.get_best_checkpoint_path() is None
    _save(mgr, 1)
    _save(mgr, 10)
    _save(mgr, 9)
    root = tmp_path / "ckpts"
    for name in ("step_11-hf", "tmp_step_12", "step_x", "old_step_3"):
        (root / name).mkdir()
    (root / "step_13").write_text("a file, not a checkpoint")
    assert mgr.get_latest_checkpoint_path() == root / "step_10"


# ---------------------------------------------------------------------------------------------------- item 67
def test_top_k_lower_is_better_keeps_best_plus_latest(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name="train:loss", higher_is_better=False, keep_top_k=3, save_period=1)
    for step, loss in enumerate([0.5, 0.3, 0.7, 0.2, 0.4, 0.8], start=1):
        _save(mgr, step, {"train:loss": loss})
    assert _steps(mgr) == [2, 4, 5, 6]  # 0.3, 0.2, 0.4 are best; 6 (0.8) survives as latest
    assert mgr.get_best_checkpoint_path() == tmp_path / "ckpts" / "step_4"


def test_top_k_higher_is_better(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name="val:accuracy", keep_top_k=2, save_period=1)
    for step, acc in enumerate([0.1, 0.9, 0.5, 0.7, 0.2], start=1):
        _save(mgr, step, {"val:accuracy": acc})
    assert _steps(mgr) == [2, 4, 5]
    assert mgr.get_best_checkpoint_path().name == "step_2"


def test_equal_metrics_keep_most_recent(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name="train:loss", higher_is_better=False, keep_top_k=2, save_period=1)
    for step in range(1, 6):
        _save(mgr, step, {"train:loss": 1.0})
    assert _steps(mgr) == [4, 5]
    assert mgr.get_best_checkpoint_path().name == "step_5"  # ties go to the most recent


def test_missing_metrics_rank_worst(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name="train:loss", higher_is_better=False, keep_top_k=3, save_period=1)
    losses = {1: 0.1, 2: 0.2, 3: None, 4: 0.3, 5: None, 6: 0.9, 7: float("nan")}
    for step in range(1, 13):
        loss = losses.get(step)
        _save(mgr, step, {} if loss is None and step not in losses else {"train:loss": loss})
    assert _steps(mgr) == [1, 2, 4, 12]


def test_missing_metrics_rank_worst_higher_is_better(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name="val:accuracy", keep_top_k=2, save_period=1)
    _save(mgr, 1, {"val:accuracy": 0.1})
    _save(mgr, 2, {})
    _save(mgr, 3, {"val:accuracy": 0.05})
    _save(mgr, 4, {})
    assert _steps(mgr) == [1, 3, 4]


def test_keep_top_k_none_keeps_everything(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name="train:loss", higher_is_better=False, keep_top_k=None, save_period=1)
    for step in range(1, 8):
        _save(mgr, step, {"train:loss": float(step)})
    assert _steps(mgr) == list(range(1, 8))
    assert mgr.remove_old_checkpoints() == []


def test_best_checkpoint_warns_on_missing_and_falls_back_to_latest(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name="val:accuracy", keep_top_k=None)
    _save(mgr, 1, {"val:accuracy": 0.4})
    _save(mgr, 2, {})
    with pytest.warns(UserWarning, match=r"\[2\]"):
        assert mgr.get_best_checkpoint_path().name == "step_1"
    only_missing = CheckpointManager(CheckpointingConfig(keep_top_k=None), tmp_path / "other")
    _save(only_missing, 3, {})
    _save(only_missing, 5, {})
    with pytest.warns(UserWarning):
        assert only_missing.get_best_checkpoint_path().name == "step_5"
    no_metric = CheckpointManager(CheckpointingConfig(metric_name=None, keep_top_k=None), tmp_path / "ckpts")
    assert no_metric.get_best_checkpoint_path().name == "step_2"


# ---------------------------------------------------------------------------------------------------- item 68
def test_top_k_without_metric_keeps_most_recent(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name=None, keep_top_k=2, save_period=1)
    for step in range(1, 6):
        _save(mgr, step)
    assert _steps(mgr) == [4, 5]


def test_non_periodic_checkpoints_survive_only_as_latest(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name=None, keep_top_k=1, save_period=2)
    for step in range(1, 8):
        _save(mgr, step)
    assert _steps(mgr) == [6, 7]  # 7 is non-periodic but latest; 6 is the most recent periodic
    _save(mgr, 8)
    assert _steps(mgr) == [8]


def test_metric_top_k_ranks_only_periodic(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, metric_name="val:accuracy", keep_top_k=1, save_period=2)
    acc = {1: 0.99, 2: 0.3, 3: 0.95, 4: 0.6, 5: 0.97, 6: 0.4, 7: 0.98, 8: 0.1}
    for step, a in acc.items():
        _save(mgr, step, {"val:accuracy": a})
    assert _steps(mgr) == [4, 8]  # best periodic (4) + latest (8); non-periodic high scorers dropped


def test_remove_old_checkpoints_returns_deleted(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, keep_top_k=None, metric_name=None, save_period=1)
    for step in range(1, 5):
        _save(mgr, step)
    mgr.cfg = CheckpointingConfig(keep_top_k=1, metric_name=None, save_period=1)
    assert mgr.remove_old_checkpoints() == [1, 2, 3]
    assert _steps(mgr) == [4]


# ---------------------------------------------------------------------------------------------------- item 69
def test_resume_paths(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    ckpt = tmp_path / "ckpts" / "step_3"
    (ckpt / "policy" / "weights").mkdir(parents=True)
    (ckpt / "policy" / "optimizer").mkdir()
    (ckpt / "value" / "weights").mkdir(parents=True)
    assert mgr.get_resume_paths(ckpt) == (ckpt / "policy" / "weights", ckpt / "policy" / "optimizer")
    with pytest.warns(UserWarning, match="optimizer"):
        assert mgr.get_resume_paths(ckpt, "value") == (ckpt / "value" / "weights", None)


# ---------------------------------------------------------------------------------------------------- item 47
INITIAL = GRPOSaveState(0, 0, 0, 0, 0, -99999999.0, None)


def test_save_state_defaults() -> None:
    assert load_save_state({}) == INITIAL
    assert load_save_state(None) == INITIAL
    assert GRPOSaveState() == INITIAL


def test_save_state_legacy_dict_fills_defaults_and_drops_metric() -> None:
    legacy = {"consumed_samples": 64, "current_step": 2, "current_epoch": 0, "total_steps": 2, "val:accuracy": 0.5}
    state = load_save_state(legacy)
    assert state.total_valid_tokens == 0 and state.val_reward == -99999999.0 and state.sampler_name is None
    assert state.consumed_samples == 64 and state.total_steps == 2
    assert "val:accuracy" not in state.to_dict()
    assert load_save_state({"val_reward": None, "total_steps": 3}) == GRPOSaveState(total_steps=3)


def test_save_state_round_trip_through_checkpoint(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    state = GRPOSaveState(consumed_samples=32, current_step=4, total_steps=4, total_valid_tokens=128, val_reward=0.8)
    info = {**state.to_dict(), "val:accuracy": 0.8}
    path = mgr.finalize_checkpoint(mgr.init_tmp_checkpoint(4, info))
    restored = load_save_state(mgr.load_training_info(path))
    assert restored == state
    assert (restored.current_step, restored.total_steps, restored.total_valid_tokens) == (4, 4, 128)
    assert restored.val_reward == 0.8


def test_prune_failure_only_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.utils import checkpoint as ckpt_mod

    mgr = _manager(tmp_path, keep_top_k=1, metric_name=None, save_period=1)
    _save(mgr, 1)

    def fail(path: Path) -> None:
        raise PermissionError(f"denied: {path}")

    monkeypatch.setattr(ckpt_mod, "_delete_dir", fail)
    with pytest.warns(UserWarning, match="could not remove old checkpoint"):
        path = _save(mgr, 2)
    assert mgr.get_latest_checkpoint_path() == path and _steps(mgr) == [1, 2]


# ---------------------------------------------------------------------------------------------------- issue 14
# Nothing executable is read back; a manifest marks a complete checkpoint; retention and stale temporaries.


def _logged(tmp_path: Path, **cfg: Any) -> tuple[CheckpointManager, list[str]]:
    lines: list[str] = []
    return CheckpointManager(CheckpointingConfig(**cfg), tmp_path / "ckpts", log=lines.append), lines


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    import hashlib

    mgr = _manager(tmp_path, save_period=2)
    path = _save(mgr, 4, {"total_steps": 4})
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == "relayrl-checkpoint-manifest" and manifest["version"] == 1
    assert manifest["step"] == 4 and manifest["periodic"] is True and manifest["save_period"] == 2
    assert sorted(manifest["files"]) == ["policy/weights/model.bin", "training_info.json"]
    for rel, entry in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(path) is None
    assert json.loads((_save(mgr, 5) / MANIFEST).read_text())["periodic"] is False


@pytest.mark.parametrize("damage", ["truncated", "no_manifest", "modified", "file_missing", "bad_manifest"])
def test_damaged_newest_checkpoint_is_skipped_with_a_message(tmp_path: Path, damage: str) -> None:
    mgr, lines = _logged(tmp_path, keep_top_k=None)
    previous = _save(mgr, 2)
    newest = _save(mgr, 3)
    weights = newest / "policy" / "weights" / "model.bin"
    if damage == "truncated":
        weights.write_bytes(b"w" * 5)
    elif damage == "no_manifest":
        (newest / MANIFEST).unlink()
    elif damage == "modified":
        weights.write_bytes(b"x" * 16)  # same size: only the hash tells
    elif damage == "file_missing":
        weights.unlink()
    else:
        (newest / MANIFEST).write_text('{"format": "relayrl-checkpoint-manifest", "version": 1, "files": {"../x": {}}}')
    restarted, lines = _logged(tmp_path, keep_top_k=None)
    assert restarted.get_latest_checkpoint_path() == previous
    assert len(lines) == 1 and str(newest) in lines[0] and "Skipping" in lines[0]
    expected = {
        "truncated": "model.bin is 5 bytes",
        "no_manifest": "no manifest.json",
        "modified": "sha256",
        "file_missing": "model.bin is missing",
        "bad_manifest": "invalid entry",
    }[damage]
    assert expected in lines[0]
    if damage == "modified":  # sizes match, so the cheap check used for retention still counts it complete
        assert 3 in restarted.complete_checkpoints()
    else:
        assert list(restarted.complete_checkpoints()) == [2]


def test_no_complete_checkpoint_means_a_fresh_start(tmp_path: Path) -> None:
    mgr, lines = _logged(tmp_path)
    (tmp_path / "ckpts" / "step_5").mkdir()  # e.g. a partial copy of a run directory
    assert mgr.get_latest_checkpoint_path() is None
    assert mgr.get_best_checkpoint_path() is None
    assert "step_5" in lines[0] and "no manifest.json" in lines[0]


@pytest.mark.parametrize("legacy_file", ["train_dataloader.pt", "rng_state.pt"])
def test_old_pickle_checkpoint_is_refused_naming_the_file(tmp_path: Path, legacy_file: str) -> None:
    marker = tmp_path / "marker"
    mgr = _manager(tmp_path)
    _save(mgr, 2)
    old = tmp_path / "ckpts" / "step_4"
    (old / "policy").mkdir(parents=True)
    (old / "training_info.json").write_text('{"total_steps": 4}')
    (old / legacy_file).write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(CheckpointError) as err:
        mgr.get_latest_checkpoint_path()
    message = str(err.value)
    assert message.startswith(str(old / legacy_file)) and "\n" not in message and "older relayrl" in message
    assert not marker.exists()


def test_pruning_keeps_best_k_and_newest_complete_after_save_period_changes(tmp_path: Path) -> None:
    cfg = dict(metric_name="val:accuracy", higher_is_better=True, keep_top_k=2)
    first = _manager(tmp_path, save_period=2, **cfg)
    for step, acc in {2: 0.9, 4: 0.8, 6: 0.1, 7: 0.95}.items():  # 7: a final save, not periodic
        _save(first, step, {"val:accuracy": acc})
    assert _steps(first) == [2, 4, 7]
    first.close()
    # Resumed with another save_period: 2 and 4 stay periodic (as recorded when written), so they stay best-2.
    resumed = _manager(tmp_path, save_period=5, **cfg)
    _save(resumed, 10, {"val:accuracy": 0.3})
    assert _steps(resumed) == [2, 4, 10]
    _save(resumed, 15, {"val:accuracy": 0.85})
    assert _steps(resumed) == [2, 15]  # best-2 periodic: 0.9 (2) and 0.85 (15), which is also the newest
    # A damaged newer directory never shields nor costs the newest complete checkpoint.
    _save(resumed, 20, {"val:accuracy": 0.0})
    (tmp_path / "ckpts" / "step_20" / "policy" / "weights" / "model.bin").write_bytes(b"")
    _save(resumed, 17, {"val:accuracy": 0.2})  # not periodic: survives only as the newest complete one
    assert _steps(resumed) == [2, 15, 17, 20]
    assert resumed.get_latest_checkpoint_path() == tmp_path / "ckpts" / "step_17"


def test_stale_tmp_dirs_are_removed_at_start_by_the_owner(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mgr = _manager(tmp_path)
    _save(mgr, 1)
    stale = mgr.init_tmp_checkpoint(2, {})
    (stale / "half_written").write_bytes(b"...")
    mgr.close()
    restarted, lines = _logged(tmp_path)
    assert not stale.exists() and (root / "step_1").is_dir()
    assert lines == [f"Removed {stale}: a checkpoint save that never completed"]


def test_a_live_run_owns_its_checkpoint_dir(tmp_path: Path) -> None:
    """Another process's manager holds the directory: this one is refused and deletes nothing; once that process
    is SIGKILLed (its lock goes with it), the next manager owns the directory and removes the stale temporary."""
    root = tmp_path / "ckpts"
    root.mkdir()
    stale = root / "tmp_step_3"
    code = (
        "import sys, time; from relayrl.config import CheckpointingConfig; "
        "from relayrl.utils.checkpoint import CheckpointManager; "
        "m = CheckpointManager(CheckpointingConfig(), sys.argv[1]); m.init_tmp_checkpoint(3, {}); "
        "print('ready', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with pytest.raises(
            CheckpointError, match=f"checkpoint directory .* is in use by pid {proc.pid} on .*; wait for it"
        ):
            CheckpointManager(CheckpointingConfig(), root)
        assert stale.is_dir()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.time() + 10
    while True:  # the kernel drops the lock with the process
        try:
            mgr, lines = _logged(tmp_path)
            break
        except CheckpointError:
            assert time.time() < deadline
            time.sleep(0.1)
    assert not stale.exists() and len(lines) == 1


def test_managers_of_one_process_share_ownership(tmp_path: Path) -> None:
    a = _manager(tmp_path)
    b = _manager(tmp_path)
    _save(a, 1)
    _save(b, 2)
    a.close()
    b.close()
    c = _manager(tmp_path)
    assert c.get_latest_checkpoint_path() == tmp_path / "ckpts" / "step_2"

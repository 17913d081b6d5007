from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from relayrl.config import CheckpointingConfig, MasterConfig
from relayrl.utils.checkpoint import CheckpointManager, GRPOSaveState, load_save_state


def _manager(tmp_path: Path, **cfg: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(**cfg), tmp_path / "ckpts")


def _save(mgr: CheckpointManager, step: int, info: dict[str, Any] | None = None) -> Path:
    tmp = mgr.init_tmp_checkpoint(step, info or {"total_steps": step})
    (tmp / "policy" / "weights").mkdir(parents=True)
    (tmp / "policy" / "weights" / "model.bin").write_bytes(b"w" * 16)
    return mgr.finalize_checkpoint(tmp)


def _steps(mgr: CheckpointManager) -> list[int]:
    return list(mgr.list_checkpoints())


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
    assert sorted(p.name for p in second.iterdir()) == ["policy", "training_info.json"]


def test_resave_same_step_swaps_atomically(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    _save(mgr, 4, {"v": "old"})
    path = _save(mgr, 4, {"v": "new"})
    assert mgr.load_training_info(path) == {"v": "new"}
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["latest_checkpoint_status.json", "step_4"]


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
    assert sorted(p.name for p in root.iterdir()) == ["latest_checkpoint_status.json", "step_2"]
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

"""`policy.generation.kv_cache_dtype=fp8` end to end in the trainers: the policy calibrates its attention inputs
before the first refit (validation at start comes first here, so on the first validation batch's prompts) and after
every training step on the sequences it just trained on, and the generation engine ends up holding exactly the
scales of the last step's calibration, never the 1.0 fallback. Both trainers calibrate on the same data, so they end
with the same scales; a default run never calibrates (its numbers are unchanged: bitcheck)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from relayrl.cli.main import main
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.policy.lm_policy import Policy
from tests.helpers import metrics_rows, tiny_grpo_overrides, tiny_ppo_overrides

RUN = ("grpo.max_num_steps=2", "grpo.val_period=0", "logger.tensorboard_enabled=false", "checkpointing.enabled=false")


class Spies:
    """Records what the real calibration saw and returned, what training saw, and which engines got scales."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calibrations: list[tuple[torch.Tensor, torch.Tensor, dict[str, float]]] = []  # ids, lengths, layers
        self.trained_ids: list[torch.Tensor] = []
        self.engines: list[HfGeneration] = []
        calibrate, train, set_scales = Policy.calibrate_qkv_fp8_scales, Policy.train, HfGeneration.set_kv_scales

        def calibrate_spy(policy: Policy, data: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            out = calibrate(policy, data, *args, **kwargs)
            assert kwargs.get("include_q") is True  # as the reference calls it
            self.calibrations.append((data["input_ids"].clone(), data["input_lengths"].clone(), dict(out["layers"])))
            return out

        def train_spy(policy: Policy, data: Any, *args: Any, **kwargs: Any) -> Any:
            self.trained_ids.append(data["input_ids"].clone())
            return train(policy, data, *args, **kwargs)

        def set_spy(engine: HfGeneration, scales: Any) -> None:
            self.engines.append(engine)
            set_scales(engine, scales)

        monkeypatch.setattr(Policy, "calibrate_qkv_fp8_scales", calibrate_spy)
        monkeypatch.setattr(Policy, "train", train_spy)
        monkeypatch.setattr(HfGeneration, "set_kv_scales", set_spy)


def unpadded(ids: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [row[: int(n)].tolist() for row, n in zip(ids, lengths)]


def run(tmp_path, model_dir, data_plane: str, *extra: str) -> list[dict[str, Any]]:
    run_dir = tmp_path / f"run_{data_plane}"
    args = tiny_grpo_overrides(model_dir, *RUN, f"data_plane.enabled={data_plane}", *extra)
    assert main(["train", "--run-dir", str(run_dir), *args]) == 0
    return metrics_rows(run_dir)


def test_fp8_grpo_generation_holds_each_steps_calibration(tmp_path, tiny_model_dir, monkeypatch, caplog) -> None:
    caplog.set_level(logging.WARNING)
    final: dict[str, dict[str, float]] = {}
    for data_plane in ("false", "true"):
        spies = Spies(monkeypatch)
        rows = run(tmp_path, tiny_model_dir, data_plane, "policy.generation.kv_cache_dtype=fp8")
        # validation at start (first validation batch: 8 problems), then after step 1 and step 2: 16 rows each
        assert [len(ids) for ids, _, _ in spies.calibrations] == [8, 16, 16]
        engine = spies.engines[-1]
        assert len(set(map(id, spies.engines))) == 1 and engine.requires_kv_scale_sync
        last = spies.calibrations[-1][2]
        assert engine.kv_scales == last  # the policy's calibration of step 2, exactly
        assert len(last) == 2 * 3  # 2 layers x (q, k, v), the reference's names
        assert all(0 < v < 0.5 and v != 1.0 for v in last.values()), last
        assert spies.calibrations[1][2] != last  # recalibrated after each step: the weights moved
        if data_plane == "false":  # the calibration saw the sequences each step trained on
            assert len(spies.trained_ids) == 2
            for (ids, _, _), trained in zip(spies.calibrations[1:], spies.trained_ids):
                assert torch.equal(ids, trained)
        timed = [r for r in rows if "timing/train/recompute_kv_scales" in r]
        assert [r["step"] for r in timed] == [1, 2]
        assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
        final[data_plane] = last
        monkeypatch.undo()
    # the data-plane trainer read the same step data back from the store: same scales to float32 rounding
    assert final["true"].keys() == final["false"].keys()
    for name, value in final["false"].items():
        assert final["true"][name] == pytest.approx(value, rel=1e-5), name
    assert "without calibrated scales" not in caplog.text


def test_default_cache_never_calibrates(tmp_path, tiny_model_dir, monkeypatch) -> None:
    spies = Spies(monkeypatch)
    rows = run(tmp_path, tiny_model_dir, "false", "grpo.max_num_steps=1")
    assert spies.calibrations == [] and spies.engines == []
    assert not any("timing/train/recompute_kv_scales" in r for r in rows)


@pytest.mark.parametrize("data_plane", ["false", "true"], ids=["legacy", "data_plane"])
def test_fp8_ppo_generation_holds_each_steps_calibration(tmp_path, tiny_model_dir, monkeypatch, data_plane) -> None:
    spies = Spies(monkeypatch)
    run_dir = tmp_path / "ppo"
    extra = ("ppo.max_num_steps=2", "ppo.val_period=0", "ppo.val_at_start=false", "checkpointing.enabled=false")
    args = tiny_ppo_overrides(tiny_model_dir, *extra, f"data_plane.enabled={data_plane}")
    assert main(["train", "--run-dir", str(run_dir), *args, "policy.generation.kv_cache_dtype=fp8"]) == 0
    # no validation first: the first step's prompts (4 x 2 rows), then each step's 8 trained rows
    assert [len(ids) for ids, _, _ in spies.calibrations] == [8, 8, 8]
    assert unpadded(*spies.calibrations[0][:2]) != unpadded(*spies.calibrations[1][:2])  # prompts, then sequences
    assert spies.engines[-1].kv_scales == spies.calibrations[-1][2]
    assert sorted(r["step"] for r in metrics_rows(run_dir) if "timing/train/recompute_kv_scales" in r) == [1, 2]


def test_fp8_run_resumes_exactly_with_its_scales(tmp_path, tiny_model_dir, monkeypatch) -> None:
    """The checkpoint keeps the scales calibrated after its step, so a resumed run generates its next step with the
    same FP8 cache as the uninterrupted run and logs the same metrics."""
    extra = ("policy.generation.kv_cache_dtype=fp8", "checkpointing.enabled=true", "cluster.deterministic=true")
    spies = Spies(monkeypatch)
    whole = run(tmp_path, tiny_model_dir, "false", *extra)
    whole_scales = spies.engines[-1].kv_scales
    monkeypatch.undo()
    spies = Spies(monkeypatch)
    resumed_dir = tmp_path / "resumed"
    args = tiny_grpo_overrides(tiny_model_dir, *RUN, "data_plane.enabled=false", *extra)
    assert main(["train", "--run-dir", str(resumed_dir), *args, "grpo.max_num_steps=1"]) == 0
    calls = len(spies.calibrations)
    assert main(["train", "--run-dir", str(resumed_dir), *args]) == 0
    assert len(spies.calibrations) == calls + 1  # only after step 2: step 2's rollout used the checkpoint's scales
    assert spies.engines[-1].kv_scales == whole_scales
    step2 = [r for r in metrics_rows(resumed_dir) if r.get("step") == 2 and "train/loss" in r]
    expected = [r for r in whole if r.get("step") == 2 and "train/loss" in r]
    assert [r["train/loss"] for r in step2] == [r["train/loss"] for r in expected]
    assert [r["train/reward"] for r in step2] == [r["train/reward"] for r in expected]

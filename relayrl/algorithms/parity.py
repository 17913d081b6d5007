"""`relayrl parity`: run the legacy and the data-plane trainer on one config and seed, compare every step's metrics.

The config's `algorithm` picks the pair: `grpo_train` / `grpo_train_sync`, or `ppo_train` / `ppo_train_sync` (then
the `critic/*` metrics, explained variance and value grad norm included, are compared too).

The two trainers differ only in where rollout tensors live, so on CPU in deterministic mode their per-step
metrics must be identical; on multi-process backends they must agree to a tolerance. Timing, throughput and byte
counters legitimately differ and are not compared.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TypedDict

from relayrl.config import MasterConfig
from relayrl.utils.jsonl import read_jsonl


class ParityReport(TypedDict):
    max_abs_diff: dict[str, float]  # metric -> largest |difference| over steps
    missing: list[str]  # metrics or steps one run lacks
    steps: list[int]


_NOT_COMPARED = ("timing/", "performance/", "data_plane/", "refit/")
_NOT_COMPARED_NAMES = ("per_sec", "bytes", "fraction")


def run_parity(cfg: MasterConfig, out_dir: Path, steps: int | None = None, async_grpo: bool = False) -> ParityReport:
    """Train `cfg` twice (legacy, data plane) under `out_dir`; return per-metric largest differences. With
    `async_grpo`, the pair is the data-plane trainer and asynchronous GRPO with a staleness bound of 0 (the same
    schedule, so the same metrics; async adds its `async/*` metrics, which the sync run lacks and are not compared)."""
    from relayrl.algorithms.setup import run_training

    updates: dict[str, object] = {"cluster": cfg.cluster.model_copy(update={"deterministic": True})}
    if steps is not None:
        updates[cfg.algorithm] = cfg.rollout.model_copy(update={"max_num_steps": steps})
    base = cfg.model_copy(update=updates)
    if async_grpo:
        if cfg.algorithm != "grpo":
            raise ValueError("relayrl parity --async compares GRPO trainers; the config's algorithm is ppo")
        plane = base.data_plane.model_copy(update={"enabled": True})
        sync_cfg = base.model_copy(update={"data_plane": plane})
        sync_cfg.grpo = sync_cfg.grpo.model_copy(
            update={"async_grpo": sync_cfg.grpo.async_grpo.model_copy(update={"enabled": False})}
        )
        async_cfg = sync_cfg.model_copy(deep=True)
        async_cfg.grpo.async_grpo = async_cfg.grpo.async_grpo.model_copy(
            update={"enabled": True, "max_trajectory_age_steps": 0}
        )
        run_training(MasterConfig.model_validate(sync_cfg.model_dump()), out_dir / "data_plane")
        run_training(MasterConfig.model_validate(async_cfg.model_dump()), out_dir / "async")
        return compare_runs(out_dir / "data_plane", out_dir / "async")
    legacy_cfg = base.model_copy(update={"data_plane": base.data_plane.model_copy(update={"enabled": False})})
    sync_cfg = base.model_copy(update={"data_plane": base.data_plane.model_copy(update={"enabled": True})})
    run_training(MasterConfig.model_validate(legacy_cfg.model_dump()), out_dir / "legacy")
    run_training(MasterConfig.model_validate(sync_cfg.model_dump()), out_dir / "data_plane")
    return compare_runs(out_dir / "legacy", out_dir / "data_plane")


def compare_runs(legacy_dir: Path, sync_dir: Path) -> ParityReport:
    """{metric: largest |difference| over steps}, plus metrics or steps that one run lacks."""
    a, b = _per_step(legacy_dir), _per_step(sync_dir)
    diffs: dict[str, float] = {}
    missing: list[str] = []
    for step in sorted(set(a) | set(b)):
        if step not in a or step not in b:
            missing.append(f"step {step} only in {'legacy' if step in a else 'data_plane'}")
            continue
        for key, value in a[step].items():
            if key not in b[step]:
                missing.append(f"step {step}: {key} missing from the data-plane run")
                continue
            diffs[key] = max(diffs.get(key, 0.0), _difference(value, b[step][key]))
    return {"max_abs_diff": diffs, "missing": missing, "steps": sorted(a)}


def _difference(x: object, y: object) -> float:
    if isinstance(x, bool) or isinstance(y, bool) or not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
        return 0.0 if x == y else math.inf
    if math.isnan(x) and math.isnan(y):
        return 0.0
    return abs(float(x) - float(y))


def _per_step(run_dir: Path) -> dict[int, dict[str, object]]:
    out: dict[int, dict[str, object]] = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        kept = {
            k: v
            for k, v in row.items()
            if k != "step" and not k.startswith(_NOT_COMPARED) and not any(n in k for n in _NOT_COMPARED_NAMES)
        }
        out.setdefault(int(row["step"]), {}).update(kept)
    return out

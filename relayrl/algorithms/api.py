"""`relayrl.train`: the Python entry point, for a user with their own data, reward functions and model.

It does what `relayrl train` does (one set-up, the trainer the config selects, GRPO or PPO) but takes what a script
has in hand: a config as a path, a dict or a `MasterConfig`; overrides as a dict or dotted `key=value` strings;
datasets as a list of dicts, a `datasets.Dataset` or a path; reward functions as plain callables
(`f(prompts, completions, **columns) -> list[float]`). Errors in the inputs raise `ConfigError` or `SetupError` with
one line naming the problem, before any model loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.config import REWARD_FNS_TASK, MasterConfig, apply_environment_defaults
from relayrl.utils.config_io import ConfigError, load_config, parse_override, set_override, validate_config
from relayrl.utils.jsonl import read_jsonl

ConfigLike = str | Path | Mapping[str, Any] | MasterConfig | None
EnvironmentFactory = type | Mapping[str, type] | None
Overrides = Mapping[str, Any] | Sequence[str] | None


@dataclass
class TrainResult:
    """What a finished run left: its directory, the last value of every logged metric, its last checkpoint."""

    run_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    """Last logged value of each metric (`train/reward`, `train/reward/<name>`, `validation/accuracy`, ...)."""
    checkpoint: Path | None = None
    """The latest complete `checkpoints/step_N` directory (None with checkpointing off)."""
    summary: dict[str, object] = field(default_factory=dict)
    """Validation accuracy at the first and last validation, as `relayrl train` prints it."""


def resolve_config(config: ConfigLike = None, overrides: Overrides = None) -> dict[str, Any]:
    """The raw (unvalidated) config dict of `config` with `overrides` applied."""
    if config is None or isinstance(config, str | Path):
        raw = load_config(config).model_dump(mode="json", exclude_unset=True) if config is not None else {}
    elif isinstance(config, MasterConfig):
        raw = config.model_dump(mode="json", exclude_unset=True)
    elif isinstance(config, Mapping):
        raw = json.loads(json.dumps(dict(config)))  # a deep copy: the caller's dict is never changed
    else:
        raise ConfigError(f"config must be a path, a dict or a MasterConfig, got {type(config).__name__}")
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_override(raw, str(key), value, merge=True)
    elif overrides is not None:
        if isinstance(overrides, str):
            overrides = [overrides]
        for item in overrides:
            set_override(raw, *parse_override(item))
    return raw


def _dataset_rows(dataset: Any, arg: str) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """(config of the `data.*` block, rows handed over) for one dataset argument."""
    if isinstance(dataset, str | Path):
        path = Path(dataset).expanduser()
        if path.is_file():
            return {"source": "file", "path": str(path)}, None
        if path.is_dir():
            return {"source": "hf", "path": str(path)}, None
        raise ConfigError(f"{arg} path does not exist: {path}")
    if hasattr(dataset, "column_names") and hasattr(dataset, "to_list"):  # a datasets.Dataset
        return {"source": "python"}, [dict(r) for r in dataset.to_list()]
    if hasattr(dataset, "keys") and hasattr(dataset, "column_names"):  # a DatasetDict
        raise ConfigError(f"{arg} is a DatasetDict with splits {sorted(dataset)}; pass one split, e.g. ds['train']")
    if isinstance(dataset, Iterable) and not isinstance(dataset, Mapping | bytes):
        rows = list(dataset)
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
        if bad is not None:
            raise ConfigError(f"{arg} row {bad + 1} is a {type(rows[bad]).__name__}, not a dict of columns")
        return {"source": "python"}, [dict(r) for r in rows]
    raise ConfigError(f"{arg} must be a list of dicts, a datasets.Dataset or a path, got {type(dataset).__name__}")


def build_run_config(
    config: ConfigLike = None,
    *,
    reward_fns: Sequence[Callable[..., Any]] | None = None,
    train_dataset: Any = None,
    val_dataset: Any = None,
    overrides: Overrides = None,
    environment_factory: EnvironmentFactory = None,
) -> tuple[MasterConfig, list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """The validated config of a `train` call and the rows it hands over (train, validation)."""
    raw = resolve_config(config, overrides)
    data = raw.setdefault("data", {})
    train_rows = val_rows = None
    if train_dataset is not None:
        block, train_rows = _dataset_rows(train_dataset, "train_dataset")
        data["train"] = {**(data.get("train") or {}), **block}
        if data.get("validation") is None and val_dataset is None:
            data["validation"] = None  # the arithmetic task's held-out set would not fit a user's data
    if val_dataset is not None:
        block, val_rows = _dataset_rows(val_dataset, "val_dataset")
        data["validation"] = {**(data.get("validation") or {}), **block}
    if reward_fns and environment_factory is None:  # they score every row naming no task, as env.reward_fns do
        for key in ("train", "validation"):
            if key == "train" or data.get("validation") is not None:
                block = data.setdefault(key, {}) if key == "train" else data[key]
                block.setdefault("default_task", REWARD_FNS_TASK)
    cfg = validate_config(raw)
    if environment_factory is not None:
        _check_factory(environment_factory)
        try:  # the class's rows: the datasets' default task, or routed by their `environment` column
            apply_environment_defaults(cfg, several=isinstance(environment_factory, Mapping))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return cfg, train_rows, val_rows


def _check_factory(factory: Any) -> None:
    classes = factory.values() if isinstance(factory, Mapping) else [factory]
    if isinstance(factory, Mapping) and not factory:
        raise ConfigError("environment_factory is an empty dict; give {name: class, ...}")
    bad = next((c for c in classes if not isinstance(c, type)), None)
    if bad is not None:
        raise ConfigError(f"environment_factory must be a class (or a dict of classes), got {type(bad).__name__}")


def train(
    config: ConfigLike = None,
    *,
    reward_fns: Sequence[Callable[..., Any]] | None = None,
    train_dataset: Any = None,
    val_dataset: Any = None,
    run_dir: str | Path | None = None,
    overrides: Overrides = None,
    environment_factory: EnvironmentFactory = None,
) -> TrainResult:
    """Train with GRPO or PPO (`algorithm`) and return the run's directory, final metrics and last checkpoint.

    `reward_fns` (called as `f(prompts, completions, **columns) -> list[float]`, weighted by `env.reward_weights`)
    score the rows; datasets are lists of dicts, `datasets.Dataset`s or paths (JSONL / Parquet file, or a
    `save_to_disk` directory). A `run_dir` that holds checkpoints resumes from the latest one.

    `environment_factory`: a TRL-style environment class (or {name: class}, rows routed by their `environment`
    column), one instance per rollout: `reset(**row)`, public documented methods as tools, optional
    `get_reward()`; the reward functions then score its episodes too (see `relayrl.environments.tool_env`).
    """
    from relayrl.algorithms.setup import UserInputs, run_training
    from relayrl.utils.paths import next_run_dir

    cfg, train_rows, val_rows = build_run_config(
        config,
        reward_fns=reward_fns,
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        overrides=overrides,
        environment_factory=environment_factory,
    )
    fresh = run_dir is None
    directory = next_run_dir("runs") if run_dir is None else Path(run_dir)
    inputs = UserInputs(
        train_rows=train_rows,
        val_rows=val_rows,
        reward_fns=list(reward_fns or []),
        environment_factory=dict(environment_factory)
        if isinstance(environment_factory, Mapping)
        else environment_factory,
    )
    summary = run_training(cfg, directory, inputs, new_run_dir=fresh, announce=True)
    return TrainResult(
        run_dir=directory,
        metrics=last_metrics(directory / "metrics.jsonl"),
        checkpoint=latest_checkpoint(cfg, directory),
        summary=summary,
    )


def last_metrics(path: Path) -> dict[str, float]:
    """The last value of every metric in a run's metrics.jsonl (rows of one step may be split across lines)."""
    out: dict[str, float] = {}
    if path.is_file():
        for row in read_jsonl(path, warn=False):
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    out[key] = float(value)
    return out


def latest_checkpoint(cfg: MasterConfig, run_dir: Path) -> Path | None:
    """The run's latest complete checkpoint directory."""
    from relayrl.utils.checkpoint import CheckpointManager

    if not cfg.checkpointing.enabled:
        return None
    return CheckpointManager(
        cfg.checkpointing, Path(cfg.checkpointing.checkpoint_dir or run_dir / "checkpoints")
    ).get_latest_checkpoint_path()

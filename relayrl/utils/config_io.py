"""Load a run config: YAML file (optionally inheriting via `defaults:`), dotted CLI overrides, pydantic validation.

Every failure becomes one `ConfigError` line naming the offending key, which the CLI prints with exit code 2.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from relayrl.config import MasterConfig
from relayrl.config.nemo_layout import NemoLayoutError, notice_line, translate_nemo_layout


class ConfigError(ValueError):
    """A user-facing configuration problem (bad key, bad value, unreadable file)."""


#: "not used by relayrl" lines already printed by this process (each is printed once).
_ANNOUNCED: set[str] = set()


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> MasterConfig:
    """Read `path` (or start from the schema defaults), apply `key.sub=value` overrides, read NeMo RL's layout into
    relayrl's (`config.nemo_layout`: its unused keys named on one stderr line, once per process), validate."""
    raw: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        set_override(raw, key, value)
    try:
        translated = translate_nemo_layout(raw)
    except NemoLayoutError as exc:
        raise ConfigError(str(exc)) from None
    cfg = validate_config(translated.config)
    if translated.unused:  # a config that loads: a refused one shows its one error line only
        line = notice_line(translated.unused)
        if line not in _ANNOUNCED:
            _ANNOUNCED.add(line)
            print(line, file=sys.stderr)
    return cfg


def validate_config(raw: dict[str, Any]) -> MasterConfig:
    try:
        return MasterConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None


def dump_config(cfg: MasterConfig, path: Path) -> None:
    """Write the fully resolved config (every default spelled out) so a run directory explains itself."""
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def _read_yaml(path: Path, _seen: set[Path] | None = None) -> dict[str, Any]:
    seen = _seen or set()
    path = path.expanduser().resolve()
    if path in seen:
        raise ConfigError(f"config inheritance cycle at {path}")
    seen.add(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    parent = data.pop("defaults", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"'defaults' in {path} must be a path to another YAML file")
    base = _read_yaml(path.parent / parent, seen)
    return _deep_merge(base, data)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """`key.sub=value` -> (key, value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.subkey=value")
    key, text = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def set_override(raw: dict[str, Any], key: str, value: Any, merge: bool = False) -> None:
    """Set dotted `key` in the raw config dict; with `merge`, a dict value merges into a section already there."""
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    old = node.get(parts[-1])
    node[parts[-1]] = _deep_merge(old, value) if merge and isinstance(old, dict) and isinstance(value, dict) else value


def _one_line(exc: ValidationError) -> str:
    """First error of a pydantic ValidationError as `key: message (got value)`."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "config"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return f"unknown config key: {loc}"
    got = err.get("input")
    suffix = "" if isinstance(got, dict) or err["type"].startswith("value_error") else f" (got {got!r})"
    more = len(exc.errors()) - 1
    tail = f" [+{more} more]" if more > 0 else ""
    return f"invalid config value for {loc}: {msg}{suffix}{tail}" if loc != "config" else f"invalid config: {msg}{tail}"


# ---------------------------------------------------------------------------------------------------- resume
#: Keys whose change on resume keeps the resumed run exact up to the change (cadence, length, logging, deadlines).
_RESUME_SAFE_PREFIXES = (
    "logger.",
    "checkpointing.save_period",
    "checkpointing.keep_top_k",
    "checkpointing.enabled",
    "policy.generation.colocated.",  # where generation runs (colocated or on nodes of its own): placement, below
)
_RESUME_SAFE_EXACT = (
    "checkpointing.checkpoint_must_save_by",
    "data_plane.call_timeout_s",
    "data_plane.init_timeout_s",
    "cluster.start_timeout_s",
    "cluster.call_timeout_s",
    # where the ranks and generation workers run, not what they compute: a run resumes exactly on a new cluster, with
    # other CPU reservations, with generation colocated or on nodes of its own (the executor is not among them: it
    # selects the data plane's default backend)
    "cluster.ray_address",
    "cluster.cpus_per_worker",
)
_RESUME_SAFE_ROLLOUT = (
    "max_num_steps",
    "max_num_epochs",
    "val_period",
    "val_start_at",
    "val_at_start",
    "val_at_end",
    "stop_at_validation_metric",
    "stop_at_validation_threshold",
    "non_finite",
)
#: Keys restored from the checkpoint's optimizer and scheduler state: a change would be silently overwritten.
_RESTORED_PREFIXES = ("policy.optimizer.", "policy.scheduler.", "value.optimizer.", "value.scheduler.")


def config_changes(old: MasterConfig, new: MasterConfig) -> list[tuple[str, object, object]]:
    """Every leaf that differs between two resolved configs, as (dotted key, old value, new value), in key order."""
    a, b = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def classify_resume_changes(
    old: MasterConfig, new: MasterConfig
) -> tuple[list[tuple[str, object, object]], list[tuple[str, object, object]], list[tuple[str, object, object]]]:
    """(safe, inexact, restored) changes for resuming a run recorded with `old` under `new`.

    safe: apply and keep the run exact up to the change; inexact: the resumed run can no longer equal an
    uninterrupted one (model, data, batch shape, seed, algorithm, ...); restored: optimizer/scheduler settings the
    checkpoint's state would overwrite.
    """
    safe, inexact, restored = [], [], []
    block = new.algorithm
    greedy = old.rollout.val_greedy and new.rollout.val_greedy
    for change in config_changes(old, new):
        key = change[0]
        rollout_key = key.split(".", 1)[1] if key.startswith(f"{block}.") else None
        # validation size only matters to training when sampled validation consumes the generation RNG
        val_size = rollout_key in ("max_val_samples", "val_batch_size") and greedy
        if key.startswith(_RESTORED_PREFIXES):
            restored.append(change)
        elif (
            key.startswith(_RESUME_SAFE_PREFIXES)
            or key in _RESUME_SAFE_EXACT
            or rollout_key in _RESUME_SAFE_ROLLOUT
            or val_size
            or key.startswith("ppo." if block == "grpo" else "grpo.")  # the other algorithm's block is unused
        ):
            safe.append(change)
        else:
            inexact.append(change)
    return safe, inexact, restored


def check_recorded_config(run_dir: Path, overrides: Sequence[str] = ()) -> None:
    """A run directory's `config.yaml` is what a resume continues with: ConfigError (one line) when it is missing
    while the run has checkpoints (the defaults would train instead), or when it lacks keys of a resolved config
    (truncated or edited: the missing keys would silently take their defaults). Never rewrites it."""
    path = run_dir / "config.yaml"
    checkpoint_dir = _recorded_checkpoint_dir(run_dir, overrides)
    saved = sorted(checkpoint_dir.glob("step_*/config.yaml"), key=lambda p: (len(p.parent.name), p.parent.name))
    fix = f"restore it (cp {saved[-1]} {path}) or name the run's config with --config" if saved else "restore it"
    if not path.is_file():
        if saved or (checkpoint_dir / "latest_checkpoint_status.json").is_file():
            raise ConfigError(
                f"{path} is missing but {checkpoint_dir} holds the run's checkpoints, which it describes; resuming "
                f"without it would train with the default config: {fix}"
            )
        return
    try:
        raw = _read_yaml(path)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}): {fix}") from None
    except ConfigError as exc:
        raise ConfigError(f"{exc}: {fix}") from None
    present = _flatten(raw)
    try:  # the checkpoint's copy was written with the same keys (a relayrl that knew fewer keys wrote both)
        reference = _flatten(_read_yaml(saved[-1])) if saved else None
    except (OSError, ConfigError):
        reference = None
    expected = reference or _flatten(validate_config(raw).model_dump(mode="json"))
    missing = [k for k in expected if k not in present]
    if missing:
        raise ConfigError(
            f"{path} lacks {len(missing)} key(s) of the run's resolved config (first: {missing[0]}): it is truncated "
            f"or was edited, and the missing keys would silently take their defaults; {fix}"
        )


def _recorded_checkpoint_dir(run_dir: Path, overrides: Sequence[str]) -> Path:
    """Where a run directory's checkpoints are: the overrides' checkpointing.checkpoint_dir, else its config's (read
    as it is, however damaged), else RUN_DIR/checkpoints."""
    for key, value in reversed([parse_override(item) for item in overrides]):
        if key == "checkpointing.checkpoint_dir" and value:
            return Path(str(value))
    try:
        value = yaml.safe_load((run_dir / "config.yaml").read_text())["checkpointing"]["checkpoint_dir"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        value = None
    return Path(str(value)) if value else run_dir / "checkpoints"


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def describe_config(cfg: BaseModel) -> str:
    """The resolved config as YAML that `--config` reads back, each field preceded by its description as comments
    (a field without one has none); what `relayrl config show` prints."""
    lines: list[str] = []
    _describe(cfg, 0, lines)
    return "\n".join(lines) + "\n"


def _describe(model: BaseModel, depth: int, lines: list[str]) -> None:
    indent = "  " * depth
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        text = " ".join((info.description or "").split())
        if text:
            width = max(40, 118 - len(indent))
            lines.extend(f"{indent}# {part}" for part in textwrap.wrap(text, width))
        if isinstance(value, BaseModel):
            lines.append(f"{indent}{name}:")
            _describe(value, depth + 1, lines)
        else:
            dumped = yaml.safe_dump(_plain(value), default_flow_style=True, width=10_000).strip()
            dumped = dumped.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"{indent}{name}: {dumped}")


def _plain(value: Any) -> Any:
    """A field value as YAML-safe data (models inside lists or dicts as their JSON dumps)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value

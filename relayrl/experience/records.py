"""Where prompts come from: the built-in arithmetic task, a local JSONL / Parquet file, a Hugging Face `datasets`
dataset (`source: hf`) or rows handed over in Python (`relayrl.train(train_dataset=...)`), read into
`PromptRecord`s with every row checked (a missing field fails at start-up with the row named).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.config import REWARD_FNS_TASK, DataConfig, DatasetConfig, MasterConfig
from relayrl.experience.arithmetic import all_problems, split_problems

_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class PromptRecord:
    """One raw prompt: either `prompt` text or a `messages` list, plus its answer (None when the row has none) and
    task (environment) name. Rows scored by reward functions keep their other columns and 1-based source row."""

    answer: str | None
    task: str
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # ((role, content), ...)
    columns: dict[str, Any] | None = None
    row: int | None = None


# ---------------------------------------------------------------------------------------------------- sources
def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet file (format from the extension) as dicts."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"dataset file does not exist: {path}")
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"unsupported dataset file extension {suffix!r} for {path}; use .jsonl or .parquet")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path} line {line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_no}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def read_hf_rows(cfg: DatasetConfig, key: str) -> list[dict[str, Any]]:
    """Rows of a `datasets` dataset: `load_from_disk` for a directory it wrote, else `load_dataset(path, subset)`
    (its cache and HF_DATASETS_OFFLINE honoured); a dataset with several splits is cut to `split`."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{key}.source=hf needs the datasets package, which is not installed: pip install 'relayrl[datasets]'"
        ) from None
    assert cfg.path is not None  # the config refuses source=hf without a path
    local = Path(cfg.path).expanduser()
    saved = local.is_dir() and any((local / f).is_file() for f in ("dataset_info.json", "dataset_dict.json"))
    try:
        if saved:
            ds = datasets.load_from_disk(str(local))
        else:
            ds = datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
    except Exception as exc:  # missing name, offline and not cached, unknown split: the library's first line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        how = "load_from_disk" if saved else "load_dataset"
        if not saved and datasets.config.HF_HUB_OFFLINE:  # the usual cause: say where it was looked for
            raise ValueError(
                f"{key}.path: dataset {cfg.path!r} (subset {cfg.subset}, split {cfg.split}) is not in the Hugging Face "
                f"cache {datasets.config.HF_DATASETS_CACHE} and the Hub is offline (HF_HUB_OFFLINE / "
                "HF_DATASETS_OFFLINE): load it once online into that cache, or save it with save_to_disk and set "
                "path to that directory"
            ) from None
        raise ValueError(f"{key}.path {cfg.path!r}: datasets.{how} failed ({first})") from None
    return hf_rows(ds, cfg.split, key)


def hf_rows(ds: Any, split: str, key: str) -> list[dict[str, Any]]:
    """A `datasets.Dataset` (or one split of a `DatasetDict`) as a list of row dicts."""
    if not hasattr(ds, "to_list"):  # a DatasetDict: pick the split
        if split not in ds:
            raise ValueError(f"{key}.split {split!r} is not in the dataset; its splits: {', '.join(sorted(ds))}")
        ds = ds[split]
    return [dict(row) for row in ds.to_list()]


def records_from_rows(
    rows: list[dict[str, Any]], cfg: DatasetConfig, source: str, episode_tasks: frozenset[str] = frozenset()
) -> list[PromptRecord]:
    """Validate and convert file rows; errors name the 1-based row and the missing field. `answer` is required only
    of rows the math verifier scores; rows of the reward-function task and of `episode_tasks` (environment classes,
    whose `reset` takes the columns) keep every column."""
    if not rows:
        raise ValueError(f"dataset {source} is empty")
    records = []
    for n, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ValueError(f"dataset {source} row {n}: expected a dict of columns, got {type(row).__name__}")
        task = row.get(cfg.task_field) if cfg.task_field else None
        task = str(task) if task is not None else cfg.default_task
        answer = field_value(row, cfg.answer_field)
        if answer is not None and cfg.answer_after is not None:
            answer = str(answer).rpartition(cfg.answer_after)[2].strip()
        if answer is None and task == "math":
            raise ValueError(
                f"dataset {source} row {n}: missing answer field {cfg.answer_field!r}, which the math verifier "
                "scores against; add it, or score with reward functions (env.reward_fns / relayrl.train(reward_fns=))"
            )
        answer = str(answer) if answer is not None else None
        extra: dict[str, Any] = {}
        if task == REWARD_FNS_TASK or task in episode_tasks:
            extra["row"] = n
            extra["columns"] = {k: v for k, v in row.items() if k not in (cfg.prompt_field, cfg.messages_field)}
        messages = row.get(cfg.messages_field)
        if messages is not None:
            if not isinstance(messages, list) or not messages:
                raise ValueError(f"dataset {source} row {n}: field {cfg.messages_field!r} must be a non-empty list")
            pairs = []
            for m in messages:
                if (
                    not isinstance(m, dict)
                    or not isinstance(m.get("role"), str)
                    or not isinstance(m.get("content"), str)
                ):
                    raise ValueError(
                        f"dataset {source} row {n}: every message in {cfg.messages_field!r} needs string role and content"
                    )
                pairs.append((m["role"], m["content"]))
            records.append(PromptRecord(answer=answer, task=task, messages=tuple(pairs), **extra))
        elif (prompt := field_value(row, cfg.prompt_field)) is not None:
            if not isinstance(prompt, str):  # bytes, lists, numbers: their text form is not the prompt
                raise ValueError(
                    f"dataset {source} row {n}: prompt field {cfg.prompt_field!r} holds {type(prompt).__name__} "
                    f"({_short(prompt)}), not text; store prompts as strings (or chats in {cfg.messages_field!r})"
                )
            records.append(PromptRecord(answer=answer, task=task, prompt=prompt, **extra))
        else:
            raise ValueError(
                f"dataset {source} row {n}: has neither prompt field {cfg.prompt_field!r} "
                f"nor messages field {cfg.messages_field!r}"
            )
    return records


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def field_value(row: dict[str, Any], name: str) -> Any:
    """`row[name]`, else for a dotted name the nested value it walks to (`prompt.0.content`: a list index), else
    None: datasets such as DAPO-Math keep the problem and answer inside nested columns."""
    if name in row or "." not in name:
        return row.get(name)
    node: Any = row
    for part in name.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _arithmetic_records(
    data: DataConfig, task: str, episode_tasks: frozenset[str] = frozenset()
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    a = data.arithmetic
    train, val = split_problems(all_problems(a.min_operand, a.max_operand, a.operations), a.num_val_problems)

    def record(p: Any, n: int) -> PromptRecord:  # reward functions get the answer as a column, like a file's
        if task != REWARD_FNS_TASK and task not in episode_tasks:
            return PromptRecord(p.answer, task, prompt=p.problem)
        return PromptRecord(p.answer, task, prompt=p.problem, columns={"answer": p.answer}, row=n)

    return [record(p, n) for n, p in enumerate(train, 1)], [record(p, n) for n, p in enumerate(val, 1)]


#: Rows handed over in Python (`relayrl.train(train_dataset=..., val_dataset=...)`) for `source: python`.
GivenRows = tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]


def _records_of(
    ds: DatasetConfig, key: str, given: list[dict[str, Any]] | None, episode_tasks: frozenset[str]
) -> list[PromptRecord]:
    """The records of a non-arithmetic dataset, from its file, its `datasets` source or the rows given."""
    if ds.source == "file":
        return records_from_rows(read_rows(_path(ds, key)), ds, str(ds.path), episode_tasks)
    if ds.source == "hf":
        return records_from_rows(read_hf_rows(ds, key), ds, str(ds.path), episode_tasks)
    arg = "train_dataset" if key == "data.train" else "val_dataset"
    if given is None:
        raise ValueError(f"{key}.source is 'python' but no rows were given: pass relayrl.train({arg}=...)")
    return records_from_rows(given, ds, arg, episode_tasks)


def load_records(
    cfg: MasterConfig, given: GivenRows = (None, None), episode_tasks: frozenset[str] = frozenset()
) -> tuple[list[PromptRecord], list[PromptRecord] | None]:
    """(train, validation) records; validation is None when the config asks for none. Rows of `episode_tasks`
    (environment classes) keep their columns and source row, as reward-function rows do."""
    data = cfg.data
    train_cfg, val_cfg = data.train, data.validation
    if train_cfg.source == "arithmetic":
        train, val = _arithmetic_records(data, train_cfg.default_task, episode_tasks)
    else:
        train = _records_of(train_cfg, "data.train", given[0], episode_tasks)
        val = None
        if val_cfg is None and train_cfg.split_validation_size > 0:
            order = list(range(len(train)))
            random.Random(cfg.rollout.seed).shuffle(order)
            num_val = max(1, round(train_cfg.split_validation_size * len(train)))
            if num_val >= len(train):
                raise ValueError(f"data.train.split_validation_size leaves no training rows out of {len(train)}")
            held = set(order[:num_val])
            val = [r for i, r in enumerate(train) if i in held]
            train = [r for i, r in enumerate(train) if i not in held]
    if val_cfg is not None:
        if val_cfg.source == "arithmetic":
            val = _arithmetic_records(data, val_cfg.default_task, episode_tasks)[1]
        else:
            val = _records_of(val_cfg, "data.validation", given[1], episode_tasks)
        val = val * val_cfg.repeat  # whole copies in order, as NeMo RL's Dataset.repeat
    return train * train_cfg.repeat, val


def _path(cfg: DatasetConfig, key: str) -> str:
    if not cfg.path:
        raise ValueError(f"{key}.path is required when {key}.source is '{cfg.source}'")
    return cfg.path

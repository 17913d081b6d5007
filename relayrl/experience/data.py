"""Prompt datasets and their loaders: the built-in arithmetic task, a local JSONL / Parquet file, a Hugging Face
`datasets` dataset (`source: hf`) or rows handed over in Python (`relayrl.train(train_dataset=...)`).

Every row is checked and tokenized when the dataset is built, so a missing field or an over-long prompt fails at
start-up with the row named, not hours into a run; nothing is truncated. Each item is one prompt in the form the
rollout consumes: a message log whose token ids are exactly the chat-template rendering of the prompt.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from relayrl.config import REWARD_FNS_TASK, DataConfig, DatasetConfig, MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.arithmetic import all_problems, split_problems
from relayrl.experience.chat_render import no_gc_pauses, render_prompts

_SUFFIXES = (".jsonl", ".parquet")
_CHUNK = 1024  # prompts rendered and tokenized per call


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
    return train, val


def _path(cfg: DatasetConfig, key: str) -> str:
    if not cfg.path:
        raise ValueError(f"{key}.path is required when {key}.source is '{cfg.source}'")
    return cfg.path


# ---------------------------------------------------------------------------------------------------- dataset
class PromptDataset(Dataset):
    """Tokenized prompts. Items: `message_log` (one message holding the rendered prompt and all its token ids),
    `length`, `extra_env_info` ({"ground_truth": answer}), `task_name`, `loss_multiplier` 1.0 and `idx`.

    Prompts over `max_prompt_length` tokens raise, or with `skip_overlong_prompts` are dropped and counted in
    `num_skipped_overlong`.
    """

    def __init__(
        self,
        records: list[PromptRecord],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        system_prompt: str | None = None,
        prompt_template: str | None = None,
        skip_overlong_prompts: bool = False,
        name: str = "dataset",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not records:
            raise ValueError(f"{name} is empty")
        _check_template(prompt_template)
        self.name = name
        self.num_skipped_overlong = 0
        self._items: list[tuple[str, torch.Tensor, PromptRecord]] = []  # (rendered, ids [P], record)
        self._conversations: dict[int, list[dict[str, str]]] = {}  # item -> its conversation (episode rows)
        conversations = []
        for rec in records:
            if rec.messages is not None:
                messages = [{"role": r, "content": c} for r, c in rec.messages]
            else:
                content = prompt_template.format(problem=rec.prompt) if prompt_template else rec.prompt
                messages = [{"role": "user", "content": content}]
            if system_prompt is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system_prompt})
            conversations.append(messages)
        for start, rendered, token_ids in render_prompts(tokenizer, conversations, chat_template_kwargs, _CHUNK):
            for k, (text, ids) in enumerate(zip(rendered, token_ids)):
                n = start + k + 1
                if len(ids) > max_prompt_length:
                    if skip_overlong_prompts:
                        self.num_skipped_overlong += 1
                        continue
                    raise ValueError(
                        f"{name} row {n}: prompt is {len(ids)} tokens, over the limit of {max_prompt_length} "
                        "(data.max_input_seq_length, else policy.max_total_sequence_length - "
                        "policy.generation.max_new_tokens); set data.skip_overlong_prompts to skip such rows"
                    )
                rec = records[n - 1]
                if rec.columns is not None and rec.task != REWARD_FNS_TASK:  # an environment class re-renders it
                    self._conversations[len(self._items)] = conversations[n - 1]
                self._items.append((text, torch.tensor(ids, dtype=torch.long), rec))
        if not self._items:
            raise ValueError(f"{name}: all {len(records)} prompts are over the limit of {max_prompt_length} tokens")
        #: Every task (environment) name the rows use, for building the task -> environment map.
        self.task_names: list[str] = sorted({item[2].task for item in self._items})

    def __len__(self) -> int:
        return len(self._items)

    def fingerprint_items(self) -> list[str]:
        """Each row as its rendered prompt, task and answer: what a resume compares with its checkpoint's data."""
        return [f"{text}\0{rec.task}\0{rec.answer}" for text, _, rec in self._items]

    def __getitem__(self, i: int) -> dict[str, Any]:
        rendered, ids, rec = self._items[i]
        return {
            "message_log": [{"role": "user", "content": rendered, "token_ids": ids.clone()}],
            "length": len(ids),
            "extra_env_info": _env_info(rec, self._conversations.get(i)),
            "task_name": rec.task,
            "loss_multiplier": 1.0,
            "idx": i,
        }


def _env_info(rec: PromptRecord, conversation: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """What the row's environment reads: the answer as `ground_truth`; for reward functions also the prompt as the
    dataset gave it (text, or a list of messages), the other columns and the 1-based source row; for environment
    classes also the conversation (system prompt and template applied) the episode re-renders with its tools."""
    info: dict[str, Any] = {"ground_truth": rec.answer} if rec.answer is not None else {}
    if rec.columns is not None:
        info["prompt"] = (
            rec.prompt if rec.prompt is not None else [{"role": r, "content": c} for r, c in rec.messages or ()]
        )
        info["columns"] = dict(rec.columns)
        info["row"] = rec.row
    if conversation is not None:
        info["messages"] = [dict(m) for m in conversation]
    return info


def _check_template(template: str | None) -> None:
    if template is None:
        return
    try:
        template.format(problem="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"data.prompt_template is not a format string with only a {{problem}} field ({type(e).__name__}: {e}); "
            "write literal braces as {{ and }}"
        ) from None


def rl_collate_fn(rows: list[dict[str, Any]]) -> BatchedDataDict:
    """Stack dataset items into the batch the rollout takes: lists for logs and infos, tensors for numbers."""
    return BatchedDataDict(
        message_log=[r["message_log"] for r in rows],
        length=torch.tensor([r["length"] for r in rows], dtype=torch.long),  # [B]
        extra_env_info=[r["extra_env_info"] for r in rows],
        task_name=[r["task_name"] for r in rows],
        loss_multiplier=torch.tensor([r["loss_multiplier"] for r in rows], dtype=torch.float32),  # [B]
        idx=torch.tensor([r["idx"] for r in rows], dtype=torch.long),  # [B]
    )


# ---------------------------------------------------------------------------------------------------- loaders
def build_datasets(
    cfg: MasterConfig, tokenizer: Any, given: GivenRows = (None, None), episode_tasks: frozenset[str] = frozenset()
) -> tuple[PromptDataset, PromptDataset | None]:
    """The train dataset and, when configured, the validation dataset (a few objects per prompt: built without the
    collector's pauses)."""
    with no_gc_pauses():
        return _build_datasets(cfg, tokenizer, given, episode_tasks)


def _build_datasets(
    cfg: MasterConfig, tokenizer: Any, given: GivenRows, episode_tasks: frozenset[str]
) -> tuple[PromptDataset, PromptDataset | None]:
    train_records, val_records = load_records(cfg, given, episode_tasks)
    common = {
        "max_prompt_length": cfg.max_prompt_length,
        "system_prompt": cfg.data.system_prompt,
        "prompt_template": cfg.data.prompt_template,
        "skip_overlong_prompts": cfg.data.skip_overlong_prompts,
        "chat_template_kwargs": cfg.policy.tokenizer.chat_template_kwargs,
    }
    train = PromptDataset(train_records, tokenizer, name="training set", **common)
    val = PromptDataset(val_records, tokenizer, name="validation set", **common) if val_records is not None else None
    return train, val


def build_dataloaders(
    cfg: MasterConfig, tokenizer: Any, given: GivenRows = (None, None), episode_tasks: frozenset[str] = frozenset()
) -> tuple[StatefulDataLoader, StatefulDataLoader | None]:
    """Train loader (seeded shuffle, whole batches only, resumable mid-epoch) and validation loader (in order).
    `episode_tasks`: the task names of environment classes (their rows keep their columns and conversation)."""
    train, val = build_datasets(cfg, tokenizer, given, episode_tasks)
    g = cfg.rollout
    batch_size = g.prompts_per_batch
    if len(train) < batch_size:
        raise ValueError(
            f"training set has {len(train)} prompts, fewer than one batch of {batch_size} "
            f"({cfg.algorithm}.num_prompts_per_step, times grpo.batch_multiplier under dynamic sampling)"
        )
    generator = torch.Generator()
    generator.manual_seed(g.seed)
    train_loader = _loader(
        train,
        batch_size=batch_size,
        shuffle=cfg.data.shuffle,
        generator=generator,
        drop_last=True,
        collate_fn=rl_collate_fn,
        num_workers=cfg.data.num_workers,
    )
    val_loader = None
    if val is not None:
        val_subset = Subset(val, range(min(len(val), g.max_val_samples)))
        val_loader = _loader(
            val_subset,
            batch_size=g.val_batch_size,
            shuffle=False,
            collate_fn=rl_collate_fn,
            num_workers=cfg.data.num_workers,
        )
    return train_loader, val_loader


def _loader(dataset: Dataset, **kwargs: Any) -> StatefulDataLoader:
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in newer torch
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, **kwargs)

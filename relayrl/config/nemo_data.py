"""NeMo RL's `data` block read into relayrl's: named datasets, ResponseDataset files, `data.default` inheritance.

NeMo RL describes each dataset (`data.train`, `data.validation`) by `dataset_name` or `data_path` with `input_key` /
`output_key`, and fills what an entry leaves out from `data.default`; its older flat layout put the same keys on
`data` itself. relayrl has one training and one validation dataset and one prompt template, so each entry becomes a
relayrl dataset block and the prompt files become `data.prompt_template` / `data.system_prompt`. What relayrl cannot
honour (several training datasets, another processor or environment) is refused with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path
from typing import Any

from relayrl.config.nemo_base import OFF, NemoLayoutError, Rules

__all__ = ["NAMED_DATASETS", "UNSUPPORTED_NAMES", "NamedDataset", "nemo_prompt_template", "translate_data"]


# ---------------------------------------------------------------------------------------------------- named datasets
# NeMo RL's registry gives each name a Hugging Face id, a split and the columns its wrapper reads; relayrl reads the
# same rows through `datasets.load_dataset` with its fields set to those columns (docs/nemo_rl_configs.md's table).
@dataclasses.dataclass(frozen=True)
class NamedDataset:
    hf_id: str
    """The Hugging Face dataset id passed to `datasets.load_dataset`."""
    split: str
    """The split NeMo RL's wrapper reads."""
    prompt_field: str
    """The column holding the problem (dotted for a nested one: `prompt.0.content`)."""
    answer_field: str
    """The column holding the reference answer (dotted for a nested one)."""
    subset: str | None = None
    """The dataset's configuration name, when it has several."""
    answer_after: str | None = None
    """Keep only the answer text after this marker (GSM8K's `####`)."""
    note: str = ""
    """How NeMo RL's wrapper reads the rows, for the docs."""
    repeat: int | None = None
    """NeMo RL's `repeat` default for the wrappers that take one (they read that many copies); None: the wrapper
    takes no `repeat`."""

    def relayrl(self) -> dict[str, Any]:
        """This dataset as relayrl's `data.train` / `data.validation` block."""
        out: dict[str, Any] = {"source": "hf", "path": self.hf_id, "split": self.split}
        out.update(prompt_field=self.prompt_field, answer_field=self.answer_field, task_field=None)
        if self.subset is not None:
            out["subset"] = self.subset
        if self.answer_after is not None:
            out["answer_after"] = self.answer_after
        return out


_DAPO = ("prompt.0.content", "reward_model.ground_truth")  # prompt and answer columns
_REPEAT = "16 copies (NeMo RL's `repeat`, default 16): `repeat: 16`, each copy sampled (`val_greedy: false`)"

#: NeMo RL dataset_name -> where relayrl reads the same rows.
NAMED_DATASETS: dict[str, NamedDataset] = {
    "OpenMathInstruct-2": NamedDataset("nvidia/OpenMathInstruct-2", "train_1M", "problem", "expected_answer"),
    "DeepScaler": NamedDataset("agentica-org/DeepScaleR-Preview-Dataset", "train", "problem", "answer"),
    "DAPOMath17K": NamedDataset("BytedTsinghua-SIA/DAPO-Math-17k", "train", *_DAPO),
    "DAPOMathAIME2024": NamedDataset("BytedTsinghua-SIA/AIME-2024", "train", *_DAPO),
    "gsm8k": NamedDataset("openai/gsm8k", "train", "question", "answer", subset="main", answer_after="####"),
    "GSM8K": NamedDataset("openai/gsm8k", "train", "question", "answer", subset="main", answer_after="####"),
    "AIME2024": NamedDataset("HuggingFaceH4/aime_2024", "train", "problem", "answer", note=_REPEAT, repeat=16),
    "AIME2026": NamedDataset("MathArena/aime_2026", "train", "problem", "answer", note=_REPEAT, repeat=16),
    "math500": NamedDataset("HuggingFaceH4/MATH-500", "test", "problem", "answer", note=_REPEAT, repeat=16),
}

#: Names NeMo RL knows whose rows relayrl cannot read as one split, with the reason given.
UNSUPPORTED_NAMES: dict[str, str] = {
    "AIME2025": "NeMo RL joins two subsets of opencompass/AIME2025; save them as one file and use ResponseDataset",
}


# ---------------------------------------------------------------------------------------------------- data block

#: Keys of a NeMo RL dataset entry (after `data.default` is merged in).
_ENTRY_KEYS = frozenset(
    "dataset_name data_path input_key output_key subset split split_validation_size seed prompt_file "
    "system_prompt_file processor env_name task_name repeat".split()
)
#: NeMo RL's older flat layout: `data.<key>` -> (entry, key in the entry).
_FLAT = {
    "dataset_name": ("train", "dataset_name"),
    "train_data_path": ("train", "data_path"),
    "train_split": ("train", "split"),
    "val_data_path": ("validation", "data_path"),
    "val_split": ("validation", "split"),
    "input_key": ("default", "input_key"),
    "output_key": ("default", "output_key"),
    "prompt_file": ("default", "prompt_file"),
    "system_prompt_file": ("default", "system_prompt_file"),
}
#: ResponseDataset's keys -> the relayrl dataset key each becomes.
_RESPONSE_KEYS = {
    "dataset_name": "source",
    "data_path": "path",
    "input_key": "prompt_field",
    "output_key": "answer_field",
}
_ENVS = {"math": "math", "reward_model": "reward_model"}  # NeMo RL env_name -> relayrl task


def nemo_prompt_template(text: str, source: str) -> str:
    """NeMo RL's prompt file (filled by `str.format(problem)`: `{}` is the problem, `{{` a brace) as relayrl's
    template (`{problem}`), keeping the escaped braces."""
    out = []
    try:
        for literal, field, spec, conv in string.Formatter().parse(text):
            out.append(literal.replace("{", "{{").replace("}", "}}"))
            if field is None:
                continue
            if field not in ("", "0") or spec or conv:
                raise ValueError(f"field {{{field}}}")
            out.append("{problem}")
    except ValueError as exc:
        raise NemoLayoutError(f"{source}: not a prompt with one {{}} for the problem ({exc})", source) from None
    return "".join(out)


def _read(path: Any, key: str) -> str:
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise NemoLayoutError(f"{key}: no such file {path} (NeMo RL reads it relative to the working directory)", key)
    return file.read_text()


def _is_nemo_entry(value: Any) -> bool:
    shared = {"split", "subset", "split_validation_size", "repeat"}  # relayrl's dataset keys too
    return isinstance(value, dict) and bool(set(value) & (_ENTRY_KEYS - shared))


def translate_data(t: Rules, section: str) -> None:
    """Map the `data` block of a NeMo RL config onto relayrl's (see the module docstring)."""
    data = t.get("data")
    if not isinstance(data, dict):
        return
    for flat, (entry, key) in _FLAT.items():  # the older layout: the same keys, one level up
        if flat in data:
            value = data.pop(flat)
            target = data.get(entry)
            if not isinstance(target, dict):
                target = data[entry] = {}
            target[key] = value
            t.mapped[f"data.{flat}"] = f"data.{entry}.{key} (NeMo RL's older flat layout)"
    if isinstance(data.get("train"), list):
        if len(data["train"]) != 1:
            raise NemoLayoutError("data.train: relayrl trains on one dataset; give one entry (or merge them)")
        data["train"] = data["train"][0]
    default = data.get("default")
    nemo = default is not None or any(_is_nemo_entry(data.get(k)) for k in ("train", "validation"))
    if not nemo:
        return
    if default is not None and not isinstance(default, dict):
        raise NemoLayoutError("data.default must be a mapping of dataset settings", "data.default")
    default = dict(default or {})
    for key in default:
        if key not in _ENTRY_KEYS:
            raise NemoLayoutError(f"unknown config key: data.default.{key}", f"data.default.{key}")
    prompts: dict[str, tuple[str, str | None]] = {}  # relayrl key -> (NeMo key, text)
    for part in ("train", "validation"):
        given = data.get(part)
        if given is None or (part == "validation" and not _is_nemo_entry(given) and not default):
            continue
        if not isinstance(given, dict):
            raise NemoLayoutError(f"data.{part} must be a mapping of dataset settings", f"data.{part}")
        data[part] = _entry(t, f"data.{part}", {**default, **given}, set(given), section, prompts)
    for target, (source, text) in prompts.items():
        if text is not None:
            t.put(target, text, source)
        else:
            t.mapped[source] = f"{target} (none)"
    data.pop("default", None)
    if data.get("validation", "absent") is None:
        data.pop("validation")


def _entry(
    t: Rules, key: str, merged: dict[str, Any], own: set[str], section: str, prompts: dict[str, tuple[str, str | None]]
) -> dict[str, Any]:
    """One NeMo RL dataset entry (its own keys over data.default's) as a relayrl dataset block."""

    def where(k: str) -> str:  # the key as the config spells it
        return f"{key}.{k}" if k in own else f"data.default.{k}"

    for k in merged:
        if k not in _ENTRY_KEYS:
            raise NemoLayoutError(f"unknown config key: {key}.{k}", f"{key}.{k}")
    name, path = merged.get("dataset_name"), merged.get("data_path")
    if name in UNSUPPORTED_NAMES:
        raise NemoLayoutError(f"{where('dataset_name')}={name!r}: {UNSUPPORTED_NAMES[name]}", where("dataset_name"))
    if name in NAMED_DATASETS:
        out = NAMED_DATASETS[name].relayrl()
        for k in ("split", "subset"):
            if k in own:
                out[k] = merged[k]
        t.mapped[where("dataset_name")] = f"{key}: source hf, path {out['path']} (docs/nemo_rl_configs.md)"
        _repeat(t, key, merged, where, NAMED_DATASETS[name].repeat, section, out)
    elif name in (None, "ResponseDataset"):
        if path is None:
            why = "set dataset_name to a named dataset, or data_path (NeMo RL's ResponseDataset)"
            raise NemoLayoutError(f"{key}: neither dataset_name nor data_path is set; {why}", f"{key}.data_path")
        local = Path(str(path)).expanduser()
        out = {"source": "file" if local.is_file() else "hf", "path": str(path), "task_field": None}
        out["prompt_field"] = merged.get("input_key", "input")
        out["answer_field"] = merged.get("output_key", "output")
        for k in ("split", "subset"):
            if merged.get(k) is not None:
                out[k] = merged[k]
        for k, target in _RESPONSE_KEYS.items():
            if k in merged:
                t.mapped[where(k)] = f"{key}.{target}"
        _repeat(t, key, merged, where, None, section, out)
    else:
        known = ", ".join(NAMED_DATASETS)
        raise NemoLayoutError(
            f"{where('dataset_name')}={name!r}: relayrl knows NeMo RL's {known} and ResponseDataset (data_path, "
            "input_key, output_key); save the rows as a file and use those",
            where("dataset_name"),
        )
    if merged.get("split_validation_size") not in OFF:
        if key != "data.train":
            raise NemoLayoutError(f"{key}.split_validation_size: only the training set is split", key)
        out["split_validation_size"] = float(merged["split_validation_size"])
        t.mapped[where("split_validation_size")] = f"{key}.split_validation_size"
    if "seed" in merged:
        seed = t.get(f"{section}.seed", 42)
        if merged["seed"] != seed:
            raise NemoLayoutError(
                f"{where('seed')}={merged['seed']!r}: relayrl splits with {section}.seed; make them equal"
            )
        t.mapped[where("seed")] = f"{section}.seed"
    processor = merged.get("processor")
    if processor not in (None, "math_hf_data_processor"):
        raise NemoLayoutError(
            f"{where('processor')}={processor!r}: relayrl renders prompts as math_hf_data_processor does",
            where("processor"),
        )
    if "processor" in merged:
        t.mapped[where("processor")] = "met: relayrl renders prompts as math_hf_data_processor does"
    env = merged.get("env_name")
    if env is not None:
        if env not in _ENVS:
            raise NemoLayoutError(
                f"{where('env_name')}={env!r}: relayrl's environments are {', '.join(_ENVS)}", where("env_name")
            )
        out["default_task"] = _ENVS[env]
        t.mapped[where("env_name")] = f"{key}.default_task"
    if "task_name" in merged:
        t.unused.append(where("task_name"))
    for nemo_key, target in (("prompt_file", "data.prompt_template"), ("system_prompt_file", "data.system_prompt")):
        if nemo_key not in merged:
            continue
        file = merged[nemo_key]
        text = None if file is None else _read(file, where(nemo_key))
        if text is not None and nemo_key == "prompt_file":
            text = nemo_prompt_template(text, where(nemo_key))
        if target in prompts and prompts[target][1] != text:
            raise NemoLayoutError(
                f"{where(nemo_key)}: relayrl uses one {target} for every dataset, and {prompts[target][0]} differs",
                where(nemo_key),
            )
        prompts[target] = (where(nemo_key), text)
    return out


def _repeat(
    t: Rules, key: str, merged: dict[str, Any], where: Any, default: int | None, section: str, out: dict[str, Any]
) -> None:
    """NeMo RL's `repeat`: its AIME and MATH-500 wrappers read `repeat` copies (default 16) and validation samples
    each one, so accuracy averages that many samples per problem. relayrl reads the same copies (`repeat`) and, for
    a validation set, samples them (`val_greedy: false`); a wrapper that takes no `repeat` ignores it, so relayrl
    refuses it there rather than repeat silently."""
    given = merged.get("repeat")
    if default is None:
        if given not in (None, 1):
            why = "only NeMo RL's AIME and MATH-500 datasets repeat their rows; remove it"
            raise NemoLayoutError(f"{where('repeat')}={given!r}: {why}", where("repeat"))
        if "repeat" in merged:
            t.mapped[where("repeat")] = "met: the rows are read once"
        return
    copies = default if given is None else int(given)
    source = where("repeat") if "repeat" in merged else where("dataset_name")
    if copies > 1:
        out["repeat"] = copies
        if key == "data.validation":
            t.put(f"{section}.val_greedy", False, source)  # NeMo RL samples every validation row
    if "repeat" in merged:
        t.mapped[where("repeat")] = f"{key}.repeat"

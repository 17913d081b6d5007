"""NeMo RL's data keys: named datasets read through `datasets.load_dataset` (tested on a dataset saved to a temporary
Hugging Face cache, offline), ResponseDataset's data_path / input_key / output_key, data.default inheritance,
prompt files filled as NeMo RL fills them, and one-line refusals for what relayrl has no equivalent of."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relayrl.config import MasterConfig
from relayrl.config.nemo_base import NemoLayoutError
from relayrl.config.nemo_data import NAMED_DATASETS, nemo_prompt_template
from relayrl.config.nemo_layout import translate_nemo_layout
from relayrl.experience.records import load_records, records_from_rows
from tests.hf_cache import offline_cache, save_to_cache

NEMO = {"policy": {"dtensor_cfg": {"enabled": True}}}  # marks the NeMo RL layout


def load(raw: dict[str, Any]) -> MasterConfig:
    return MasterConfig.model_validate(translate_nemo_layout({**NEMO, **raw}).config)


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache in tmp holding `openai/gsm8k` (config `main`, split `train`); the Hub is offline."""
    cache = offline_cache(tmp_path / "hf", monkeypatch)
    rows = [{"question": "What is 1+1?", "answer": "One and one. #### 2"}, {"question": "2+5?", "answer": "#### 7"}]
    save_to_cache(cache, "openai/gsm8k", "main", "train", rows)
    return cache


def test_a_named_dataset_loads_from_the_hugging_face_cache(hf_cache: Path) -> None:
    cfg = load({"data": {"train": {"dataset_name": "gsm8k"}, "default": {"env_name": "math"}}})
    assert (cfg.data.train.source, cfg.data.train.path, cfg.data.train.subset) == ("hf", "openai/gsm8k", "main")
    train, val = load_records(cfg)
    assert [(r.prompt, r.answer, r.task) for r in train] == [("What is 1+1?", "2", "math"), ("2+5?", "7", "math")]
    assert val is None


def test_a_named_dataset_not_in_the_cache_offline_is_one_line_naming_it_and_the_cache(hf_cache: Path) -> None:
    cfg = load({"data": {"train": {"dataset_name": "DeepScaler"}}})
    with pytest.raises(ValueError) as exc:
        load_records(cfg)
    line = str(exc.value)
    assert "\n" not in line and "'agentica-org/DeepScaleR-Preview-Dataset'" in line and str(hf_cache) in line


def test_aime_and_math500_are_read_as_nemo_rl_repeats_them(hf_cache: Path) -> None:
    """NeMo RL's AIME / MATH-500 wrappers read `repeat` whole copies (default 16) and validation samples each row:
    relayrl reads the same rows in the same order and samples them, so accuracy averages the same samples."""
    save_to_cache(hf_cache, "HuggingFaceH4/aime_2024", "default", "train", [{"problem": "P0", "answer": "3"}])
    save_to_cache(
        hf_cache, "HuggingFaceH4/MATH-500", "default", "test", [{"problem": f"M{i}", "answer": i} for i in (1, 2)]
    )
    aime = load({"data": {"train": {"dataset_name": "gsm8k"}, "validation": {"dataset_name": "AIME2024"}}})
    assert aime.data.validation is not None and (aime.data.validation.repeat, aime.grpo.val_greedy) == (16, False)
    _, val = load_records(aime)
    assert val is not None and [(r.prompt, r.answer) for r in val] == [("P0", "3")] * 16
    math = load({"data": {"train": {"dataset_name": "gsm8k"}, "validation": {"dataset_name": "math500", "repeat": 2}}})
    _, val = load_records(math)
    assert val is not None and [r.prompt for r in val] == ["M1", "M2", "M1", "M2"]  # whole copies, in order
    once = load({"data": {"train": {"dataset_name": "gsm8k"}, "validation": {"dataset_name": "math500", "repeat": 1}}})
    assert once.data.validation is not None and (once.data.validation.repeat, once.grpo.val_greedy) == (1, True)
    own = {"data": {"validation": {"source": "hf", "path": "org/set", "repeat": 3}}, "grpo": {"val_greedy": False}}
    assert translate_nemo_layout(own).config == own  # relayrl's own key: its layout passes through untouched
    with pytest.raises(ValueError, match="data.validation.repeat=16 with grpo.val_greedy=true: greedy decoding"):
        MasterConfig.model_validate({"data": {"validation": {**aime.data.validation.model_dump(), "repeat": 16}}})


def test_dapo_rows_read_their_nested_columns() -> None:
    ds = MasterConfig.model_validate({"data": {"train": NAMED_DATASETS["DAPOMath17K"].relayrl()}}).data.train
    row = {"prompt": [{"role": "user", "content": "Find x."}], "reward_model": {"ground_truth": "34"}}
    (rec,) = records_from_rows([row], ds, "dapo")
    assert (rec.prompt, rec.answer) == ("Find x.", "34")


def test_response_dataset_with_data_default_inheritance(tmp_path: Path) -> None:
    rows = [{"q": f"{a}+1", "a": str(a + 1), "question": "unused"} for a in range(20)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompt = tmp_path / "cot.txt"
    prompt.write_text("Solve {} and put it in \\boxed{{}}.")
    system = tmp_path / "system.txt"
    system.write_text("You are careful.")
    cfg = load(
        {
            "grpo": {"seed": 7},
            "data": {
                "train": {"data_path": str(path), "split_validation_size": 0.25, "seed": 7},
                "default": {
                    "dataset_name": "ResponseDataset",
                    "input_key": "q",
                    "output_key": "a",
                    "prompt_file": str(prompt),
                    "system_prompt_file": str(system),
                    "processor": "math_hf_data_processor",
                    "env_name": "math",
                },
            },
        }
    )
    t = cfg.data.train
    assert (t.source, t.prompt_field, t.answer_field, t.split_validation_size) == ("file", "q", "a", 0.25)
    assert cfg.data.system_prompt == "You are careful."
    assert cfg.data.prompt_template is not None
    assert cfg.data.prompt_template.format(problem="2+2") == prompt.read_text().format("2+2")  # NeMo RL's filling
    train, val = load_records(cfg)
    assert (len(train), len(val or [])) == (15, 5)
    assert all(r.answer == str(int((r.prompt or "").split("+")[0]) + 1) for r in train)  # input_key / output_key


def test_the_older_flat_data_layout_names_the_training_set(tmp_path: Path) -> None:
    cfg = load({"data": {"dataset_name": "DeepScaler", "prompt_file": None}})
    assert cfg.data.train.path == "agentica-org/DeepScaleR-Preview-Dataset" and cfg.data.prompt_template is None


def test_nemo_prompt_files_become_relayrl_templates() -> None:
    assert nemo_prompt_template("Q: {}\n\\boxed{{}}", "f") == "Q: {problem}\n\\boxed{{}}"
    with pytest.raises(NemoLayoutError, match="f: not a prompt with one {} for the problem"):
        nemo_prompt_template("{question}", "f")


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"train": {"dataset_name": "AIME2025"}}, "data.train.dataset_name='AIME2025': NeMo RL joins two subsets"),
        (
            {"train": {"dataset_name": "gsm8k"}, "validation": {"dataset_name": "DAPOMathAIME2024", "repeat": 2}},
            "data.validation.repeat=2: only NeMo RL's AIME and MATH-500 datasets repeat",
        ),
        ({"train": {"dataset_name": "squad"}}, "data.train.dataset_name='squad': relayrl knows NeMo RL's"),
        ({"train": {"dataset_name": "gsm8k"}, "default": {"processor": "sft_processor"}}, "data.default.processor="),
        (
            {"train": {"dataset_name": "gsm8k", "env_name": "code"}},
            "data.train.env_name='code': relayrl's environments",
        ),
        ({"train": [{"dataset_name": "gsm8k"}, {"dataset_name": "DeepScaler"}]}, "data.train: relayrl trains on one"),
        ({"train": {"input_key": "q"}, "default": {}}, "data.train: neither dataset_name nor data_path is set"),
        (
            {"train": {"dataset_name": "gsm8k", "prompt_file": "/nonexistent/cot.txt"}},
            "data.train.prompt_file: no such",
        ),
    ],
)
def test_what_relayrl_cannot_honour_is_refused_in_one_line(data: dict[str, Any], line: str) -> None:
    with pytest.raises(NemoLayoutError) as exc:
        translate_nemo_layout({**NEMO, "data": data})
    assert str(exc.value).startswith(line) and "\n" not in str(exc.value)

"""Prompt datasets: sources (arithmetic, JSONL, Parquet), the processor, every load error, and resumable loaders."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from relayrl.config import MasterConfig
from relayrl.experience.arithmetic import all_problems, split_problems
from relayrl.experience.data import PromptDataset, build_dataloaders, build_datasets, rl_collate_fn
from relayrl.experience.records import load_records

ROWS = [
    {"prompt": "12+30=", "answer": "42"},
    {"prompt": "5+7=", "answer": 12, "task": "math"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "9-10="}], "answer": "-1"},
    {"prompt": "1+1=", "answer": "2", "task": "other"},
]


def _cfg(data: dict[str, Any] | None = None, **grpo: Any) -> MasterConfig:
    """A small valid config: 2 prompts per step, batch sizes that divide evenly."""
    grpo = {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "seed": 7, **grpo}
    policy = {"train_global_batch_size": 4, "train_micro_batch_size": 4}
    return MasterConfig.model_validate({"grpo": grpo, "policy": policy, "data": data or {}})


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _file_cfg(path: Path, **data: Any) -> MasterConfig:
    return _cfg({"train": {"source": "file", "path": str(path)}, **data})


def _render(tok: Any, messages: list[dict[str, str]]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_jsonl_rows_become_rendered_prompts(tmp_path: Path, char_tokenizer) -> None:
    cfg = _file_cfg(_jsonl(tmp_path / "d.jsonl", ROWS), prompt_template="Solve {problem}", system_prompt="Sys")
    train, val = build_datasets(cfg, char_tokenizer)
    assert val is None and len(train) == 4
    item = train[0]
    expected = _render(
        char_tokenizer, [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Solve 12+30="}]
    )
    assert expected == "<|system|>Sys<|end|><|user|>Solve 12+30=<|end|><|assistant|>"
    [msg] = item["message_log"]
    assert msg["role"] == "user" and msg["content"] == expected
    assert msg["token_ids"].tolist() == char_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert item["length"] == len(msg["token_ids"])
    assert item["extra_env_info"] == {"ground_truth": "42"} and item["task_name"] == "math"
    assert item["loss_multiplier"] == 1.0 and item["idx"] == 0
    assert train[1]["extra_env_info"] == {"ground_truth": "12"}  # numbers become text
    # a messages row keeps its own system message and gets no template
    assert train[2]["message_log"][0]["content"] == "<|system|>Be brief.<|end|><|user|>9-10=<|end|><|assistant|>"
    assert [train[i]["task_name"] for i in range(4)] == ["math", "math", "math", "other"]
    assert train.task_names == ["math", "other"]


def test_parquet_matches_jsonl(tmp_path: Path, char_tokenizer) -> None:
    rows = [{"q": f"{i}+{i}=", "a": str(2 * i)} for i in range(5)]
    _jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    fields = {"prompt_field": "q", "answer_field": "a", "task_field": None, "default_task": "math"}
    datasets = []
    for name in ("d.jsonl", "d.parquet"):
        cfg = _cfg({"train": {"source": "file", "path": str(tmp_path / name), **fields}})
        datasets.append(build_datasets(cfg, char_tokenizer)[0])
    a, b = datasets
    assert len(a) == len(b) == 5
    for i in range(5):
        assert a[i]["message_log"][0]["token_ids"].tolist() == b[i]["message_log"][0]["token_ids"].tolist()
        assert a[i]["extra_env_info"] == b[i]["extra_env_info"] == {"ground_truth": str(2 * i)}


def test_arithmetic_source_uses_the_held_out_split(char_tokenizer) -> None:
    arith = {"min_operand": 10, "max_operand": 19, "operations": ["+"], "num_val_problems": 10}
    train, val = build_datasets(_cfg({"arithmetic": arith}), char_tokenizer)
    problems_train, problems_val = split_problems(all_problems(10, 19, ["+"]), 10)
    assert len(train) == 90 and len(val) == 10
    assert train[0]["message_log"][0]["content"] == f"<|user|>{problems_train[0].problem}<|end|><|assistant|>"
    assert [val[i]["extra_env_info"]["ground_truth"] for i in range(10)] == [p.answer for p in problems_val]


def test_split_validation_size_is_seeded_and_disjoint(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(20)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = _cfg({"train": {"source": "file", "path": str(path), "split_validation_size": 0.25}})
    train, val = load_records(cfg)
    assert len(train) == 15 and len(val) == 5
    assert {r.answer for r in train}.isdisjoint({r.answer for r in val})
    assert load_records(cfg)[1] == val  # same seed, same split
    cfg.grpo.seed = 8
    assert load_records(cfg)[1] != val


def test_explicit_validation_sources(tmp_path: Path) -> None:
    train_path = _jsonl(tmp_path / "train.jsonl", ROWS)
    val_path = _jsonl(tmp_path / "val.jsonl", [{"question": "3+4=", "sol": "7"}])
    val_cfg = {"source": "file", "path": str(val_path), "prompt_field": "question", "answer_field": "sol"}
    train, val = load_records(_cfg({"train": {"source": "file", "path": str(train_path)}, "validation": val_cfg}))
    assert len(train) == 4 and [(r.prompt, r.answer, r.task) for r in val] == [("3+4=", "7", "math")]
    arith = {"min_operand": 10, "max_operand": 12, "operations": ["-"], "num_val_problems": 2}
    cfg = _cfg({"train": {"source": "file", "path": str(train_path)}, "validation": {}, "arithmetic": arith})
    _, val = load_records(cfg)
    assert [r.answer for r in val] == [p.answer for p in split_problems(all_problems(10, 12, ["-"]), 2)[1]]
    with pytest.raises(ValueError, match="data.validation.path is required"):
        load_records(_cfg({"validation": {"source": "file"}}))


@pytest.mark.parametrize(
    ("name", "content", "error", "match"),
    [
        ("missing.jsonl", None, FileNotFoundError, "dataset file does not exist: .*missing.jsonl"),
        ("empty.jsonl", "", ValueError, "dataset .*empty.jsonl is empty"),
        ("d.csv", "prompt,answer\n", ValueError, "unsupported dataset file extension '.csv'"),
        ("bad.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{oops\n', ValueError, "bad.jsonl line 2: invalid JSON"),
        (
            "noans.jsonl",
            '{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n',
            ValueError,
            "row 2: missing answer field 'answer'",
        ),
        (
            "noprompt.jsonl",
            '{"answer": "1"}\n',
            ValueError,
            "row 1: has neither prompt field 'prompt' nor messages field",
        ),
    ],
)
def test_load_errors(tmp_path: Path, char_tokenizer, name: str, content: str | None, error: type, match: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(error, match=match):
        build_datasets(_file_cfg(path), char_tokenizer)


def test_overlong_prompts_fail_or_are_skipped_and_counted(tmp_path: Path, char_tokenizer) -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x" * 30, "answer": "0"}, {"prompt": "2+2=", "answer": "4"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    # "<|user|>" + 30 + "<|end|><|assistant|>" = 33 tokens; limit 20
    with pytest.raises(ValueError, match="training set row 2: prompt is 33 tokens, over the limit of 20"):
        build_datasets(_file_cfg(path, max_input_seq_length=20), char_tokenizer)
    train, _ = build_datasets(_file_cfg(path, max_input_seq_length=20, skip_overlong_prompts=True), char_tokenizer)
    assert len(train) == 2 and train.num_skipped_overlong == 1
    assert [train[i]["extra_env_info"]["ground_truth"] for i in range(2)] == ["2", "4"]
    assert [train[i]["idx"] for i in range(2)] == [0, 1]
    # the default limit: max_total_sequence_length 64 - max_new_tokens 16 = 48 tokens; 33 fits
    assert len(build_datasets(_file_cfg(path), char_tokenizer)[0]) == 3


def test_bad_template_and_too_small_dataset(tmp_path: Path, char_tokenizer) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match="data.prompt_template is not a format string"):
        build_datasets(_file_cfg(path, prompt_template="Put it in \\boxed{} {problem}"), char_tokenizer)
    cfg = _cfg({"train": {"source": "file", "path": str(path)}}, num_prompts_per_step=8)
    with pytest.raises(ValueError, match="training set has 4 prompts, fewer than one batch of 8"):
        build_dataloaders(cfg, char_tokenizer)
    with pytest.raises(ValueError, match="dataset is empty"):
        PromptDataset([], char_tokenizer, max_prompt_length=10)


def test_collate_builds_the_rollout_batch(tmp_path: Path, char_tokenizer) -> None:
    train, _ = build_datasets(_file_cfg(_jsonl(tmp_path / "d.jsonl", ROWS)), char_tokenizer)
    batch = rl_collate_fn([train[0], train[3]])
    assert batch.size == 2
    assert batch["length"].tolist() == [train[0]["length"], train[3]["length"]]
    assert batch["loss_multiplier"].dtype == torch.float32 and batch["loss_multiplier"].tolist() == [1.0, 1.0]
    assert batch["idx"].tolist() == [0, 3] and batch["task_name"] == ["math", "other"]
    assert batch["extra_env_info"] == [{"ground_truth": "42"}, {"ground_truth": "2"}]


def _ids(batch: Any) -> list[int]:
    return batch["idx"].tolist()


def test_train_loader_resumes_mid_epoch_exactly(char_tokenizer) -> None:
    arith = {"min_operand": 10, "max_operand": 14, "operations": ["+"], "num_val_problems": 5}
    cfg = _cfg({"arithmetic": arith}, max_val_samples=4, val_batch_size=2)
    loader, val_loader = build_dataloaders(cfg, char_tokenizer)
    assert len(loader) == 10  # 20 training problems, 2 per step
    reference = [_ids(b) for b in loader]
    assert sorted(i for b in reference for i in b) == list(range(20)) and reference[0] != [0, 1]  # shuffled

    loader, _ = build_dataloaders(cfg, char_tokenizer)
    it = iter(loader)
    assert [_ids(next(it)) for _ in range(3)] == reference[:3]
    state = loader.state_dict()
    resumed, _ = build_dataloaders(cfg, char_tokenizer)
    resumed.load_state_dict(state)
    assert [_ids(b) for b in resumed] == reference[3:]

    again, _ = build_dataloaders(cfg, char_tokenizer)
    assert [_ids(b) for b in again] == reference  # seeded: same order every build
    assert [_ids(b) for b in val_loader] == [[0, 1], [2, 3]]  # in order, capped at max_val_samples


def test_chat_template_kwargs_reach_every_rendering(tmp_path: Path, char_tokenizer) -> None:
    """policy.tokenizer.chat_template_kwargs (NeMo RL's key) are variables of the template at every rendering."""
    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = "{% if brief %}B:{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = _jsonl(tmp_path / "d.jsonl", ROWS[:2])
    for kwargs, first in ((None, "12+30="), ({"brief": True}, "B:12+30=")):
        raw = _file_cfg(path).model_dump(mode="json")
        raw["policy"]["tokenizer"]["chat_template_kwargs"] = kwargs
        cfg = MasterConfig.model_validate(raw)
        train, _ = build_datasets(cfg, tok)
        assert train[0]["message_log"][0]["content"] == first

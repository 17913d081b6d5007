"""Configs in the layout of NeMo RL's own examples (grpo_math_1B, grpo_smoke, the DeepScaleR recipe and its
data-plane variant, ppo_math_1B; written for these tests under tests/fixtures/nemo_rl) train two steps on the shipped model with only
the data swapped for a local file in NeMo RL's ResponseDataset keys, and `config show` classifies every key."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.utils import config_io
from tests.helpers import metrics_rows
from tests.hf_cache import offline_cache, save_to_cache

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl"
#: Two small steps, in NeMo RL's layout (cluster.gpus_per_node): the examples' sizes are for a GPU cluster.
SMALL = [
    "num_prompts_per_step=4",
    "num_generations_per_prompt=4",
    "max_num_steps=2",
    "max_val_samples=4",
    "val_batch_size=4",
]
COMMON = [
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "cluster.gpus_per_node=1",
    "checkpointing.enabled=false",
    "logger.tensorboard_enabled=false",
]
#: example -> (rollout block, how its data is swapped: the same layout the example names its dataset in)
EXAMPLES = {
    "grpo_math_1B": ("grpo", ["data.train.dataset_name=ResponseDataset", "data.train.data_path={file}"]),
    "grpo_smoke": ("grpo", ["data.train.dataset_name=ResponseDataset", "data.train.data_path={file}"]),
    "grpo-deepscaler-1.5b-8K": ("grpo", ["data.dataset_name=ResponseDataset", "data.train_data_path={file}"]),
    "grpo-deepscaler-1.5b-8K-tq_simple": ("grpo", ["data.dataset_name=ResponseDataset", "data.train_data_path={file}"]),
    "ppo_math_1B": (
        "ppo",
        [
            "data.train.dataset_name=ResponseDataset",
            "data.train.data_path={file}",
            "data.validation.dataset_name=ResponseDataset",
            "data.validation.data_path={file}",
            "ppo.ppo_epochs=1",
            "value.train_global_batch_size=16",
            "value.train_micro_batch_size=8",
        ],
    ),
}


@pytest.fixture(autouse=True)
def fresh_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_io, "_ANNOUNCED", set())  # as in a fresh process


@pytest.fixture
def response_file(tmp_path: Path) -> Path:
    """Arithmetic rows in ResponseDataset's default keys (`input`, `output`)."""
    path = tmp_path / "train.jsonl"
    rows = [{"input": f"{a}+{b}", "output": str(a + b)} for a in range(10, 18) for b in range(20, 28)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _argv(name: str, data_file: Path) -> list[str]:
    block, data = EXAMPLES[name]
    return [*(f"{block}.{o}" for o in SMALL), *COMMON, *(d.format(file=data_file) for d in data)]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_trains_two_steps_with_only_model_and_data_swapped(name, tmp_path, response_file, capsys) -> None:
    run_dir = tmp_path / "run"
    config = FIXTURES / f"{name}.yaml"
    assert main(["train", "--config", str(config), "--run-dir", str(run_dir), *_argv(name, response_file)]) == 0
    err = capsys.readouterr().err
    assert sum(line.startswith("not used by relayrl: ") for line in err.splitlines()) == 1, err
    rows = [r for r in metrics_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in rows)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_config_show_classifies_every_key(name, capsys) -> None:
    assert main(["config", "show", "--config", str(FIXTURES / f"{name}.yaml")]) == 0
    out = capsys.readouterr().out
    table = [line.removeprefix("#   ") for line in out.splitlines() if line.startswith("#   ")]
    verdicts = [line.split(": ", 1)[1] for line in table]
    kinds = ("mapped -> ", "not used by relayrl (engine-only)", "refused: ")
    assert table and all(v.startswith(kinds) for v in verdicts), table
    assert any(v.startswith("not used") for v in verdicts) and any("mapped -> data.train" in v for v in verdicts)
    assert not any(v.startswith("refused") for v in verdicts)  # each of these examples loads as it is


def test_config_show_names_every_refused_key_not_only_the_first(capsys) -> None:
    argv = ["policy.megatron_cfg.enabled=true", "ppo.async_ppo.enabled=true", "ppo.critic_ppo_epochs=3"]
    assert main(["config", "show", "--config", str(FIXTURES / "ppo_math_1B.yaml"), *argv]) == 2
    captured = capsys.readouterr()
    refused = [line for line in captured.out.splitlines() if ": refused: " in line]
    assert [line.split(":", 1)[0].strip("# ") for line in refused] == [
        "ppo.critic_ppo_epochs",
        "ppo.async_ppo.enabled",
        "policy.megatron_cfg.enabled",
    ]
    assert captured.err.count("\n") == 1 and captured.err.startswith("relayrl: error: ")


def test_a_named_dataset_offline_and_not_cached_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run_dir = tmp_path / "run"
    argv = ["train", "--config", str(FIXTURES / "grpo_math_1B.yaml"), "--run-dir", str(run_dir)]
    assert main([*argv, *(f"grpo.{o}" for o in SMALL), *COMMON]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("not used by relayrl")]
    assert len(err) == 1 and "'nvidia/OpenMathInstruct-2'" in err[0] and str(tmp_path / "empty_cache") in err[0]
    assert not run_dir.exists()


def test_grpo_smoke_trains_on_its_named_hub_dataset_from_the_cache(tmp_path, capsys, monkeypatch) -> None:
    """No data swapped: `dataset_name: gsm8k` is read from a Hugging Face cache in tmp, offline."""
    cache = offline_cache(tmp_path / "hf", monkeypatch)
    rows = [{"question": f"{a}+{b}", "answer": f"{a} plus {b} #### {a + b}"} for a in range(10, 15) for b in range(8)]
    save_to_cache(cache, "openai/gsm8k", "main", "train", rows)
    run_dir = tmp_path / "run"
    argv = ["train", "--config", str(FIXTURES / "grpo_smoke.yaml"), "--run-dir", str(run_dir)]
    assert main([*argv, *(f"grpo.{o}" for o in SMALL), *COMMON]) == 0
    train = [r for r in metrics_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["train/loss"]) for r in train)

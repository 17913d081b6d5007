"""A newcomer's own problem, end to end on the shipped model: their rows (no `answer` field), their reward
functions, through `relayrl.train` and through the CLI (issue 17's acceptance)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import relayrl
from relayrl.algorithms.api import last_metrics
from relayrl.cli.main import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

#: Small steps: 2 prompts x 4 generations.
SMALL = {
    "grpo.num_prompts_per_step": 2,
    "grpo.num_generations_per_prompt": 4,
    "policy.train_global_batch_size": 8,
    "policy.train_micro_batch_size": 8,
    "logger.progress_bar": False,
}
WEIGHTS = (0.25, 1.0)


def has_digits(prompts, completions, **columns):
    return [1.0 if any(ch.isdigit() for ch in c) else 0.0 for c in completions]


def mentions_target(prompts, completions, target, **columns):
    return [1.0 if str(t) in c else 0.0 for c, t in zip(completions, target)]


def rows() -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "target": a + b} for a in range(10, 40) for b in range(10, 12)]


def latest(run_dir: str) -> Path:
    return max(Path(run_dir, "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def _check_run(result: relayrl.TrainResult, steps: int) -> None:
    """3 steps happened, each reward function logged, and the reward is their weighted sum."""
    assert result.checkpoint is not None and result.checkpoint.name == f"step_{steps}"
    lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step: dict[int, dict] = {}
    for line in lines:
        if line["step"] > 0:  # step 0: validation before training
            per_step.setdefault(line["step"], {}).update(line)
    assert sorted(per_step) == list(range(1, steps + 1))
    for m in per_step.values():
        a, b = m["train/reward/has_digits"], m["train/reward/mentions_target"]
        assert 0.0 <= a <= 1.0 and 0.0 <= b <= 1.0
        assert m["train/reward"] == pytest.approx(WEIGHTS[0] * a + WEIGHTS[1] * b, abs=1e-6)
    assert result.metrics["train/reward/has_digits"] == per_step[steps]["train/reward/has_digits"]
    assert any(m["train/reward/has_digits"] > 0 for m in per_step.values())  # the shipped model writes numbers


def test_list_of_dicts_two_reward_functions_trains_3_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the run lands in ./runs/001, as a script's would
    result = relayrl.train(
        reward_fns=[has_digits, mentions_target],
        train_dataset=rows(),
        overrides={**SMALL, "grpo.max_num_steps": 3, "env.reward_weights": list(WEIGHTS)},
    )
    assert result.run_dir == Path("runs/001")
    _check_run(result, 3)
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all("+" in s["prompt"] for s in samples)
    # the flight recorder keeps each function's value per row, and the row's reward is their weighted sum
    table = pq.read_table(result.run_dir / "rollouts" / "step_000003.parquet").to_pylist()
    for row in table:
        parts = json.loads(row["env_metadata"])["reward_components"]
        assert set(parts) == {"has_digits", "mentions_target"} and parts["has_digits"] in (0.0, 1.0)
        weighted = WEIGHTS[0] * parts["has_digits"] + WEIGHTS[1] * (parts["mentions_target"] or 0.0)
        assert row["reward_env"] == pytest.approx(weighted, abs=1e-6)


def test_datasets_dataset_trains_3_steps(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(rows())
    result = relayrl.train(
        reward_fns=[has_digits, mentions_target],
        train_dataset=ds,
        val_dataset=ds.select(range(8)),
        run_dir=tmp_path / "run",
        overrides=[f"{k}={v}" for k, v in SMALL.items()]
        + ["grpo.max_num_steps=3", "grpo.val_period=3", "grpo.max_val_samples=8", "grpo.val_batch_size=8"]
        + [f"env.reward_weights=[{WEIGHTS[0]}, {WEIGHTS[1]}]"],
    )
    _check_run(result, 3)
    assert 0.0 <= result.metrics["validation/accuracy"] <= WEIGHTS[0] + WEIGHTS[1]


def test_cli_reward_fns_on_jsonl_without_answer(tmp_path, monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's my_rewards may be imported
    (tmp_path / "my_rewards.py").write_text(
        "def has_digits(prompts, completions, **columns):\n"
        "    return [float(any(ch.isdigit() for ch in c)) for c in completions]\n\n"
        "def mentions_target(prompts, completions, target, **columns):\n"
        "    return [float(str(t) in c) for c, t in zip(completions, target)]\n"
    )
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--run-dir", "run", "data.train.source=file", "data.train.path=data.jsonl"]
    argv += [
        "env.reward_fns=[my_rewards:has_digits, my_rewards:mentions_target]",
        f"env.reward_weights={list(WEIGHTS)}",
    ]
    argv += [f"{k}={v}" for k, v in SMALL.items()] + ["grpo.max_num_steps=3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "GRPO run in run" in out and "tensorboard --logdir run/tensorboard" in out
    _check_run(relayrl.TrainResult(Path("run"), last_metrics(Path("run/metrics.jsonl")), latest("run")), 3)


def test_a_failing_reward_function_ends_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad_rewards.py").write_text(
        "def picky(prompts, completions, target, **columns):\n    return [1.0 / (t - 35) for t in target]\n"
    )
    data = [{"prompt": f"{a}+1=", "target": a + 1} for a in range(30, 40)]  # target 35 (divides by zero): row 5
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--run-dir", "run", "data.train.source=file", "data.train.path=data.jsonl"]
    argv += ["env.reward_fns=[bad_rewards.py:picky]", "data.shuffle=false", "grpo.max_num_steps=20"]
    argv += [f"{k}={v}" for k, v in SMALL.items()]
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("relayrl")]
    assert len(err) == 1, err
    assert "reward function 'picky' failed on dataset row 5: ZeroDivisionError" in err[0]


def test_ppo_with_reward_functions(tmp_path):
    result = relayrl.train(
        CONFIGS / "ppo_arith_tiny.yaml",
        reward_fns=[has_digits, mentions_target],
        train_dataset=rows(),
        run_dir=tmp_path / "ppo",
        overrides={
            "ppo.max_num_steps": 2,
            "ppo.num_prompts_per_step": 8,
            "policy.train_global_batch_size": 32,
            "policy.train_micro_batch_size": 32,
            "value.train_global_batch_size": 32,
            "value.train_micro_batch_size": 32,
            "env.reward_weights": list(WEIGHTS),
            "logger.progress_bar": False,
        },
    )
    _check_run(result, 2)
    assert (result.checkpoint / "value").is_dir()


def test_a_model_by_hub_id_trains_from_the_cache_offline(tmp_path, monkeypatch, capsys):
    from relayrl.utils.paths import resolve_model_path
    from tests.unit.utils.test_hub_models import REPO, populate_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    small = [f"{k}={v}" for k, v in SMALL.items()] + ["grpo.max_num_steps=1"]
    missing = tmp_path / "missing_run"
    assert main(["train", "--run-dir", str(missing), "policy.model_name=someone/not-cached", *small]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("relayrl")]
    assert len(err) == 1 and "in the Hugging Face cache" in err[0] and not missing.exists()

    populate_cache(tmp_path / "hub", REPO, resolve_model_path("builtin:tiny-arith"))
    assert main(["train", "--run-dir", str(tmp_path / "run"), f"policy.model_name={REPO}", *small]) == 0
    assert (tmp_path / "run" / "checkpoints" / "step_1" / "policy" / "weights").is_dir()


def test_cli_reads_datasets_from_disk_and_by_load_dataset_with_column_mapping(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    renamed = [{"question": r["prompt"], "target": r["target"]} for r in rows()]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(renamed), "test": datasets.Dataset.from_list(renamed[:8])}
    ).save_to_disk(str(tmp_path / "saved"))
    files = tmp_path / "files"  # plain data files: datasets.load_dataset(path) reads them, split by file name
    files.mkdir()
    (files / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    (files / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed[:8]))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's my_rewards may be imported
    (tmp_path / "my_rewards.py").write_text(
        "def mentions_target(prompts, completions, target, **columns):\n"
        "    assert all(p.endswith('=') for p in prompts)  # the question column, mapped to the prompt\n"
        "    return [float(str(t) in c) for c, t in zip(completions, target)]\n"
    )
    monkeypatch.chdir(tmp_path)
    common = ["env.reward_fns=[my_rewards:mentions_target]", "grpo.max_num_steps=1", "grpo.val_period=1"]
    common += ["grpo.max_val_samples=8", "grpo.val_batch_size=8"] + [f"{k}={v}" for k, v in SMALL.items()]
    for source in ("saved", "files"):
        data = ["data.train.source=hf", f"data.train.path={source}", "data.train.prompt_field=question"]
        data += [f"data.validation={{source: hf, path: {source}, split: test, prompt_field: question}}"]
        assert main(["train", "--run-dir", f"run_{source}", *data, *common]) == 0, source
        metrics = last_metrics(Path(f"run_{source}/metrics.jsonl"))
        assert 0.0 <= metrics["validation/accuracy"] <= 1.0 and "train/reward/mentions_target" in metrics
    assert (
        main(
            [
                "train",
                "--run-dir",
                "run_bad",
                "data.train.source=hf",
                "data.train.path=saved",
                "data.train.split=dev",
                *common,
            ]
        )
        == 2
    )
    assert not Path("run_bad").exists()


def boxed_answer(prompts, completions, answer, **columns):
    """The math verifier's verdict on the arithmetic task, whose answers are short integers compared exactly."""
    from relayrl.environments.math_env import extract_boxed

    return [float((extract_boxed(c) or "").strip() == a) for c, a in zip(completions, answer)]


def test_a_reward_function_equal_to_the_verifier_reproduces_the_default_run(tmp_path):
    """Same seed, same task, the verifier's verdict computed by a reward function: the same run, step for step."""
    small = {**SMALL, "grpo.max_num_steps": 3, "grpo.val_period": 3, "grpo.max_val_samples": 16}
    small["grpo.val_batch_size"] = 16
    runs = [
        relayrl.train(run_dir=tmp_path / "verifier", overrides=small),
        relayrl.train(reward_fns=[boxed_answer], run_dir=tmp_path / "function", overrides=small),
    ]
    lines = [[json.loads(x) for x in (r.run_dir / "metrics.jsonl").read_text().splitlines()] for r in runs]
    rewards = [[m["train/reward"] for m in run if "train/reward" in m] for run in lines]
    assert len(rewards[0]) == 3 and rewards[0] == rewards[1]
    assert runs[0].metrics["validation/accuracy"] == runs[1].metrics["validation/accuracy"]
    assert runs[1].metrics["train/reward/boxed_answer"] == runs[1].metrics["train/reward"]


@pytest.mark.ray
def test_a_failing_reward_function_on_ray_is_one_line_too(ray_cluster, tmp_path, monkeypatch, capsys):
    """On the Ray executor the functions run in the rollout actor; Ray's wrapper around the error is stripped."""
    (tmp_path / "bad_rewards.py").write_text(
        "def picky(prompts, completions, answer, **columns):\n    return [1.0 / (int(a) - 50) for a in answer]\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--config", str(CONFIGS / "grpo_arith_ray_2cpu.yaml"), "--run-dir", "run"]
    argv += ["env.reward_fns=[bad_rewards.py:picky]", "grpo.num_prompts_per_step=4", "grpo.val_at_start=false"]
    argv += ["grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16", "grpo.max_num_steps=50"]
    argv += ["policy.train_micro_batch_size=8", "logger.progress_bar=false"]
    argv += ["cluster.workers_per_node=1"]  # the function fails in the rollout actor: one rank to start, not two
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("relayrl")]
    assert len(err) == 1 and re.search(r"reward function 'picky' failed on dataset row \d+: ZeroDivisionError", err[0])

"""relayrl.train's inputs: config as path / dict / object, overrides as dict or strings, datasets of every form."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import relayrl
from relayrl.algorithms.api import build_run_config, resolve_config
from relayrl.config import MasterConfig
from relayrl.utils.config_io import ConfigError, describe_config, load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def f(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_import_relayrl_stays_light_and_exports_the_api():
    import subprocess
    import sys

    code = "import sys, relayrl; assert 'torch' not in sys.modules and 'pydantic' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"
    assert relayrl.load_config is load_config and callable(relayrl.train)


def test_config_forms_agree():
    path = CONFIGS / "ppo_arith_tiny.yaml"
    from_path = build_run_config(path)[0]
    assert build_run_config(str(path))[0] == from_path
    assert build_run_config(load_config(path))[0] == from_path
    assert build_run_config(yaml.safe_load(path.read_text()))[0] == from_path
    assert from_path.algorithm == "ppo"


def test_overrides_as_dict_nested_dict_or_strings():
    a = build_run_config(None, overrides={"grpo.max_num_steps": 3, "policy": {"optimizer": {"kwargs": {"lr": 1e-4}}}})[
        0
    ]
    b = build_run_config(None, overrides=["grpo.max_num_steps=3", "policy.optimizer.kwargs.lr=1e-4"])[0]
    assert a == b and a.grpo.max_num_steps == 3 and a.policy.optimizer.kwargs.lr == 1e-4
    assert a.policy.max_total_sequence_length == MasterConfig().policy.max_total_sequence_length  # merged, not replaced
    with pytest.raises(ConfigError, match="unknown config key"):
        build_run_config(None, overrides={"grpo.nope": 1})


def test_datasets_set_the_source_and_reward_fns_the_task(tmp_path):
    rows = [{"prompt": "1+1=", "x": 1}]
    cfg, train, val = build_run_config(None, reward_fns=[f], train_dataset=rows)
    assert (cfg.data.train.source, cfg.data.train.default_task, cfg.data.validation, train, val) == (
        "python", "reward_fns", None, rows, None
    )  # fmt: skip
    datasets = pytest.importorskip("datasets")
    cfg, train, _ = build_run_config(None, train_dataset=datasets.Dataset.from_list(rows), val_dataset=rows)
    assert train == rows and cfg.data.validation.source == "python" and cfg.data.train.default_task == "math"
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    cfg, train, _ = build_run_config(None, train_dataset=tmp_path / "d.jsonl")
    assert (cfg.data.train.source, cfg.data.train.path, train) == ("file", str(tmp_path / "d.jsonl"), None)
    with pytest.raises(ConfigError, match="row 1 is a str"):
        build_run_config(None, train_dataset=["a"])
    with pytest.raises(ConfigError, match="does not exist"):
        build_run_config(None, train_dataset=tmp_path / "missing.jsonl")


def test_resolve_config_never_changes_the_callers_dict():
    given = {"grpo": {"max_num_steps": 5}}
    resolve_config(given, {"grpo.max_num_steps": 7})
    assert given == {"grpo": {"max_num_steps": 5}}


def test_config_show_reads_back_and_carries_descriptions():
    cfg = load_config(CONFIGS / "qwen2.5_0.5b_instruct_grpo.yaml", ["env.reward_fns=[m:f]"])
    text = describe_config(cfg)
    assert MasterConfig.model_validate(yaml.safe_load(text)) == cfg
    lines = text.splitlines()
    i = lines.index("  reward_fns: ['m:f']")
    assert lines[i - 1].startswith("  # ") and "f(prompts, completions" in " ".join(lines[i - 4 : i])

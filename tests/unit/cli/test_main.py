"""CLI bad input: one line on stderr naming the problem, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.cli.main import main


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["grpo.not_a_key=1"], "unknown config key: grpo.not_a_key"),
        (["grpo.num_prompts_per_step=abc"], "grpo.num_prompts_per_step"),
        (["grpo.num_prompts_per_step=0"], "grpo.num_prompts_per_step"),
        (["policy.train_global_batch_size=-4"], "policy.train_global_batch_size"),
        (["policy.train_micro_batch_size=0"], "policy.train_micro_batch_size"),
        (["grpo.num_prompts_per_step=3"], "not divisible by policy.train_global_batch_size"),
        (["oops"], "must look like key.subkey=value"),
    ],
)
def test_bad_config_exits_2_with_one_line(capsys, tmp_path, overrides, needle):
    code, err = _run(capsys, ["train", "--run-dir", str(tmp_path / "run"), *overrides])
    assert code == 2
    assert needle in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing created for a run that never started


def test_missing_config_file(capsys, tmp_path):
    code, err = _run(capsys, ["train", "--config", str(tmp_path / "nope.yaml")])
    assert code == 2 and "config file not found" in err


def test_missing_model_path_exits_2(capsys, tmp_path):
    code, err = _run(capsys, ["train", "--run-dir", str(tmp_path / "r"), f"policy.model_name={tmp_path / 'none'}"])
    assert code == 2 and "does not exist" in err and len(err.splitlines()) == 1


def test_dataset_errors_exit_2(capsys, tmp_path, tiny_model_dir):
    base = ["train", "--run-dir", str(tmp_path / "r"), f"policy.model_name={tiny_model_dir}", "data.train.source=file"]
    missing = tmp_path / "missing.jsonl"
    code, err = _run(capsys, [*base, f"data.train.path={missing}"])
    assert code == 2 and "missing.jsonl" in err

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = _run(capsys, [*base, f"data.train.path={empty}"])
    assert code == 2 and "empty" in err.lower()

    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    code, err = _run(capsys, [*base, f"data.train.path={no_answer}"])
    assert code == 2 and "answer" in err

    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps({"prompt": "1+" * 200 + "1=", "answer": "201"}) + "\n")
    code, err = _run(capsys, [*base, f"data.train.path={long_prompt}"])
    assert code == 2 and "long" in err.lower()


def test_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli.main", "train", "policy.precision=float64"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("relayrl: error: invalid config value for policy.precision")
    assert not Path(tmp_path / "runs").exists()


def test_ray_combinations_that_cannot_work_are_refused_clearly(capsys, tmp_path):
    """Refused in one line before any worker (or Ray) starts."""
    run_dir = ["train", "--run-dir", str(tmp_path / "r"), "cluster.executor=ray"]
    code, err = _run(capsys, [*run_dir, "cluster.gpus_per_worker=1"])  # colocated generation on GPUs
    assert code == 2 and "cluster.executor=ray with GPUs" in err and len(err.splitlines()) == 1
    code, err = _run(capsys, [*run_dir, "data_plane.backend=memory"])  # an in-process store for Ray workers
    assert code == 2 and "data_plane.backend=memory" in err and len(err.splitlines()) == 1
    code, err = _run(capsys, [*run_dir, "policy.generation.colocated.enabled=false"])  # no generation workers
    assert code == 2 and "colocated.resources" in err and len(err.splitlines()) == 1
    code, err = _run(capsys, [*run_dir, "cluster.workers_per_node=2"])  # 128 rows cannot make 2 x 128-row shards
    assert code == 2 and "multiple of 256" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("overrides", "address", "prefix"),
    [
        ([], "10.0.0.1:6379", ""),  # the local executor and store: no cluster to find again
        (["cluster.executor=ray"], "10.0.0.1:6379", "RAY_ADDRESS=10.0.0.1:6379 "),  # joined through RAY_ADDRESS
        (["data_plane.backend=transfer_queue"], "10.0.0.1:6379", "RAY_ADDRESS=10.0.0.1:6379 "),
        (["cluster.executor=ray", "cluster.ray_address=10.0.0.2:6379"], "10.0.0.1:6379", ""),  # recorded in config
        (["cluster.executor=ray"], None, ""),  # a local Ray started for the run
    ],
)
def test_the_resume_hint_is_the_command_that_finds_the_cluster(monkeypatch, tmp_path, overrides, address, prefix):
    from relayrl.cli.main import _resume_command
    from relayrl.utils.config_io import load_config

    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    cfg = load_config(None, overrides)
    assert _resume_command(cfg, tmp_path / "run") == f"{prefix}relayrl train --run-dir {tmp_path / 'run'}"

"""The flight recorder on the default run, and what reads it: exact replay, diff and inspect (issue 18).

Every run here is the embedded default config (the shipped model, 16 prompts x 8 generations) for 3 steps without
validation: a few seconds each on a CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from relayrl.cli.main import main
from relayrl.data_plane.recorder import recorded_steps
from tests.helpers import assert_breakdown_adds_up

STEPS = 3
BASE = (
    f"grpo.max_num_steps={STEPS}",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "logger.tensorboard_enabled=false",
    "logger.progress_bar=false",
)
CKPT = ("checkpointing.save_period=1", "checkpointing.keep_top_k=null")


def _train(run_dir: Path, *overrides: str) -> Path:
    assert main(["train", "--run-dir", str(run_dir), *BASE, *overrides]) == 0
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flight")
    return {
        "a": _train(root / "a", *CKPT),
        "a_again": _train(root / "a_again", "logger.flight_recorder.keep_last=2"),
        "other_seed": _train(root / "other_seed", "grpo.seed=7"),
    }


def _train_metrics(path: Path) -> dict[int, dict[str, object]]:
    out: dict[int, dict[str, object]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        step = row.pop("step")
        out.setdefault(step, {}).update({k: v for k, v in row.items() if k.startswith("train/")})
    return out


def test_recorder_writes_readable_step_files(runs):
    rollouts = runs["a"] / "rollouts"
    assert recorded_steps(rollouts) == [1, 2, 3]
    table = pq.read_table(rollouts / "step_000002.parquet")
    assert table.num_rows == 128
    cols = table.to_pydict()
    for name in ("sample_key", "prompt_group", "weight_version", "input_ids", "token_mask", "generation_logprobs",
                 "reference_policy_logprobs", "reward_env", "reward", "advantages", "sample_mask", "env_metadata",
                 "prompt", "completion"):  # fmt: skip
        assert name in cols, name
    assert len(set(cols["sample_key"])) == 128 and set(cols["weight_version"]) == {1}
    assert len(set(cols["prompt_group"])) == 16
    for ids, mask, lp, n in zip(
        cols["input_ids"], cols["token_mask"], cols["generation_logprobs"], cols["input_lengths"]
    ):
        assert len(ids) == len(mask) == len(lp) == n  # unpadded, token-aligned
    # the file's mean reward is the step's logged train/reward (no dynamic sampling: every generated row trains)
    logged = _train_metrics(runs["a"] / "metrics.jsonl")[2]["train/reward"]
    assert sum(cols["reward"]) / 128 == pytest.approx(logged, abs=1e-7)
    assert all(c.endswith("}") for c in cols["completion"] if "boxed" in c)
    # keep_last bounds the files on disk
    assert recorded_steps(runs["a_again"] / "rollouts") == [2, 3]


def test_replay_equals_the_recorded_metrics(runs, tmp_path, capsys):
    out = tmp_path / "replay"
    assert main(["replay", str(runs["a"]), "--from-step", "2", "--to-step", "3", "--out", str(out)]) == 0
    assert "train/* values equal the recorded run's" in capsys.readouterr().out
    recorded, replayed = _train_metrics(runs["a"] / "metrics.jsonl"), _train_metrics(out / "metrics.jsonl")
    assert sorted(replayed) == [2, 3]
    assert assert_breakdown_adds_up(out, timed=("data_plane", "policy_training")) == 2
    for step in (2, 3):
        want = {k: v for k, v in recorded[step].items() if not k.endswith("per_sec")}
        got = {k: v for k, v in replayed[step].items() if not k.endswith("per_sec")}
        assert got == want, f"step {step}"
    # a changed loss setting replays on the same data and moves the loss
    changed = tmp_path / "changed"
    argv = [
        "replay",
        str(runs["a"]),
        "--from-step",
        "2",
        "--out",
        str(changed),
        "--set",
        "loss_fn.reference_policy_kl_penalty=0.5",
    ]
    assert main(argv) == 0
    moved = _train_metrics(changed / "metrics.jsonl")[2]
    assert moved["train/reward"] == recorded[2]["train/reward"] and moved["train/loss"] != recorded[2]["train/loss"]


def test_replay_names_the_missing_checkpoint(runs, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(runs["a"], run, ignore=shutil.ignore_patterns("*.lock"))
    shutil.rmtree(run / "checkpoints" / "step_1")
    assert main(["replay", str(run), "--from-step", "2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "needs the checkpoint step_1" in err and "checkpointing.save_period=1" in err


def test_diff_first_divergence_and_identical(runs, capsys):
    assert main(["diff", str(runs["a"]), str(runs["a_again"])]) == 0
    assert capsys.readouterr().out.startswith("identical: 3 common steps")
    assert main(["diff", str(runs["a"]), str(runs["other_seed"])]) == 1
    out = capsys.readouterr().out
    assert out.startswith("first divergence: step 1, metric train/")
    assert "first differing sample of step 1: row " in out


def test_inspect_worst_samples(runs, capsys):
    assert main(["inspect", str(runs["a"]), "--step", "2", "--worst", "3"]) == 0
    out = capsys.readouterr().out
    shown = [float(line.split("advantage ")[1].split()[0]) for line in out.splitlines() if line.startswith("row ")]
    advantages = sorted(pq.read_table(runs["a"] / "rollouts" / "step_000002.parquet").column("advantages").to_pylist())
    assert shown == pytest.approx(advantages[:3], abs=1e-3)
    assert "completion:" in out and "log-prob gaps" in out


def test_legacy_trainer_records_the_same_rollouts(runs, tmp_path, capsys):
    legacy = _train(tmp_path / "legacy", "data_plane.enabled=false")
    a = pq.read_table(runs["a"] / "rollouts" / "step_000001.parquet").to_pydict()
    b = pq.read_table(legacy / "rollouts" / "step_000001.parquet").to_pydict()
    for name in ("prompt_group", "prompt", "completion", "reward_env", "reward", "input_ids", "token_mask",
                 "generation_logprobs", "reference_policy_logprobs", "sample_mask", "env_metadata"):  # fmt: skip
        assert a[name] == b[name], name
    # replayed from step 1 (the initial weights: no checkpoint needed) on the data-plane trainer, exactly
    assert main(["replay", str(legacy), "--from-step", "1", "--to-step", "3", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "train/* values equal the recorded run's" in out and "byte counters not compared" in out

"""`relayrl train --config configs/nemo_layout_grpo.yaml` (a config in NeMo RL's layout) trains on the shipped model:
two small steps on both trainers with identical metrics, the unused NeMo RL keys named on exactly one stderr line,
and a NeMo RL value relayrl cannot honour stops the command with one line and exit code 2, leaving no run behind."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.utils import config_io
from tests.helpers import metrics_rows

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "nemo_layout_grpo.yaml"
#: Small, in the same layout: cluster.gpus_per_node and grpo.* are NeMo RL's keys.
SMALL = [
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_val_samples=8",
    "grpo.val_batch_size=8",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "logger.tensorboard_enabled=false",
    "cluster.gpus_per_node=1",
]


@pytest.fixture(autouse=True)
def fresh_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_io, "_ANNOUNCED", set())  # as in a fresh process


def test_nemo_layout_example_trains_two_steps_on_both_trainers(tmp_path, capsys) -> None:
    rows = {}
    for data_plane in ("false", "true"):
        run_dir = tmp_path / f"dp_{data_plane}"
        argv = [
            "train",
            "--config",
            str(EXAMPLE),
            "--run-dir",
            str(run_dir),
            *SMALL,
            f"data_plane.enabled={data_plane}",
        ]
        assert main(argv) == 0
        err = capsys.readouterr().err
        notices = [line for line in err.splitlines() if line.startswith("not used by relayrl: ")]
        assert len(notices) == (1 if data_plane == "false" else 0), err  # once per process
        rows[data_plane] = [r for r in metrics_rows(run_dir) if "train/loss" in r]
        assert [r["step"] for r in rows[data_plane]] == [1, 2]
        assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in rows[data_plane])
        if data_plane == "false":
            assert "policy.generation.backend=vllm (relayrl's own engine samples)" in notices[0]
    # the mapped warm-up (LinearLR 0.1 -> 1 over 10 steps): lr at steps 1 and 2 is 0.1 and 0.19 of 3e-5
    lrs = [r["train/lr"] for r in rows["false"]]
    assert lrs == pytest.approx([3e-6, 5.7e-6], rel=1e-6)
    for a, b in zip(rows["false"], rows["true"]):  # same run on both trainers
        assert a["train/loss"] == b["train/loss"] and a["train/reward"] == b["train/reward"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.tensor_parallel_size=2: relayrl has no"),
        ("policy.megatron_cfg.enabled=true", "policy.megatron_cfg.enabled=true: relayrl has no Megatron backend"),
        ("data.train.dataset_name=squad", "data.train.dataset_name='squad': relayrl knows NeMo RL's"),
        ("policy.dtensor_cfg.bogus_key=1", "unknown config key: policy.dtensor_cfg.bogus_key"),
    ],
)
def test_a_value_relayrl_cannot_honour_is_one_line_and_exit_2(tmp_path, capsys, override, expected) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(EXAMPLE), "--run-dir", str(run_dir), *SMALL, override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"relayrl: error: {err[0].removeprefix('relayrl: error: ')}"] and expected in err[0], err
    assert not run_dir.exists()

"""Asynchronous GRPO end to end on the tiny test model: d = 0 is the sync trainer, d = 1 is deterministic, resumes
exactly after SIGKILL with rollouts in flight, leaks no key, accounts for stale groups, and a dead producer ends the
run with one line and the resume command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from relayrl.algorithms import async_rollouts
from relayrl.algorithms.async_state import ASYNC_STATE
from relayrl.cli.main import main
from relayrl.utils.state_file import load_state_file
from tests.helpers import (
    EXACT_RUN,
    assert_breakdown_adds_up,
    metrics_by_step,
    sigkill_after_checkpoint,
    tiny_grpo_overrides,
)

STEPS = 4
ASYNC = ("grpo.async_grpo.enabled=true",)
# the shipped model: it earns rewards from step 1, so advantages (and what staleness changes) are not all zero
BASE = (
    *EXACT_RUN,
    "policy.model_name=builtin:tiny-arith",
    "policy.generation.max_new_tokens=16",
    f"grpo.max_num_steps={STEPS}",
    "grpo.val_at_start=false",
    "checkpointing.save_period=2",
)


def _metrics(run_dir: Path) -> dict[int, dict]:
    """Last logged train/validation metrics per step, machine-dependent rates and byte counters left out."""
    return metrics_by_step(run_dir, ("train/", "validation/"), skip=("per_sec", "bytes", "fraction"))


def _run(tmp_path: Path, model: Path, name: str, *extra: str) -> dict[int, dict]:
    run_dir = tmp_path / name
    assert main(["train", "--run-dir", str(run_dir), *tiny_grpo_overrides(model, *BASE, *extra)]) == 0
    return _metrics(run_dir)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    """Runs several tests read, each trained once per module: `shared(*extra)` -> (metrics, run directory)."""
    root = tmp_path_factory.mktemp("async_shared")
    cache: dict[tuple[str, ...], tuple[dict[int, dict], Path]] = {}

    def get(*extra: str) -> tuple[dict[int, dict], Path]:
        if extra not in cache:
            name = f"run{len(cache)}"
            cache[extra] = _run(root, tiny_model_dir, name, *extra), root / name
        return cache[extra]

    return get


def test_age_zero_reproduces_sync_trainer(tmp_path, tiny_model_dir, shared):
    sync, _ = shared()
    d0 = _run(tmp_path, tiny_model_dir, "async_d0", *ASYNC, "grpo.async_grpo.max_trajectory_age_steps=0")
    assert sorted(d0) == list(range(1, STEPS + 1))
    for step, row in sync.items():
        assert {k: d0[step][k] for k in row} == row, f"step {step}: async d=0 differs from sync"
        assert d0[step]["train/async/trajectory_age_mean"] == 0.0


def test_age_one_is_deterministic_and_off_policy(tmp_path, tiny_model_dir, shared):
    """Two runs of d = 1 in the other generator and reference-pass modes log what the first logs, so a run is also
    deterministic run to run (the resume test below compares a fourth, killed and resumed)."""
    a, a_dir = shared(*ASYNC)
    assert (
        assert_breakdown_adds_up(a_dir, timed=("waiting", "refit", "policy_training")) == STEPS
    )  # the trainer's wait for the producer is a phase
    producer = metrics_by_step(a_dir, ("timing/async/",), skip=())
    assert sorted(producer) == list(range(1, STEPS + 1))
    for step, m in producer.items():  # the producer's side: its idle time (staleness bound) and the queue it left
        assert m["timing/async/producer_idle"] >= 0.0 and m["timing/async/queue_depth"] in (0.0, 1.0, 2.0), (step, m)
        assert 0.0 < m["timing/async/producer_environment"] < m["timing/async/producer_generation"], (step, m)
    # the generation process samples exactly what an engine in the producer thread samples; the reference pass gives
    # the same values on either side (so `reference_pass=auto`, which picks a side by timing, cannot change a run):
    # each mode differs from the first run's (process, auto) once, the thread paired with the producer's pass
    thread = ("grpo.async_grpo.generator=thread", "grpo.async_grpo.reference_pass=producer")
    assert _run(tmp_path, tiny_model_dir, "thread_ref_producer", *ASYNC, *thread) == a
    assert _run(tmp_path, tiny_model_dir, "ref_trainer", *ASYNC, "grpo.async_grpo.reference_pass=trainer") == a
    sync, _ = shared()
    for key in ("train/reward", "train/mean_gen_tokens_per_sample"):  # batch 1: the initial weights either way
        assert a[1][key] == sync[1][key]
    assert a[2]["train/async/generating_weight_version"] == 0.0  # batch 2 too; sync generates it with version 1
    assert a[2]["train/reward"] != sync[2]["train/reward"]
    ages = [a[s]["train/async/trajectory_age_mean"] for s in range(1, STEPS + 1)]
    assert ages == [0.0, 1.0, 1.0, 1.0]
    assert [a[s]["train/async/trajectory_age_hist/1"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]
    # stale samples: pi_old recomputed, so the IS weight pi_old / pi_generator departs from 1
    assert a[STEPS]["train/sampling_importance_ratio"] != 1.0


def test_old_policy_from_the_training_forward_equals_a_separate_pass(tmp_path, tiny_model_dir, shared):
    """One optimizer step per batch: pi_old is the trainer's weights at the step's start, so the training forward's
    detached log-probs are pi_old. Against the separate old-policy pass (the reference's way), every step's loss,
    gradient and importance weight agree to float rounding, on stale (age 1) samples."""
    fused, _ = shared(*ASYNC)
    separate = _run(tmp_path, tiny_model_dir, "separate", *ASYNC, "grpo.skip_prev_logprobs_when_on_policy=false")
    assert [fused[s]["train/async/trajectory_age_mean"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]
    for step in range(1, STEPS + 1):
        for key in ("train/loss", "train/grad_norm", "train/sampling_importance_ratio", "train/reward"):
            assert fused[step][key] == pytest.approx(separate[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert fused[STEPS]["train/sampling_importance_ratio"] != 1.0  # the stale samples are corrected
    assert separate[STEPS]["train/probs_ratio"] == pytest.approx(1.0, abs=1e-5)  # pi_theta == pi_old at one step


def test_a_lora_policy_trains_asynchronously(tmp_path, tiny_model_dir):
    """Under LoRA the producer generates from the merged weights of each published version (process and thread
    alike)."""
    lora = ("policy.lora.enabled=true", "policy.lora.rank=4")
    a = _run(tmp_path, tiny_model_dir, "lora", *ASYNC, *lora)
    assert [a[s]["train/async/trajectory_age_mean"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]
    assert a[STEPS]["train/sampling_importance_ratio"] != 1.0
    assert _run(tmp_path, tiny_model_dir, "lora_thread", *ASYNC, *lora, "grpo.async_grpo.generator=thread") == a


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_producer_generates_on_its_own_stream(tmp_path, tiny_model_dir):
    """CUDA: the producer's engine is a thread on a stream of its own; runs stay deterministic and d = 0 is sync."""
    cuda = ("cluster.device=cuda",)
    a = _run(tmp_path, tiny_model_dir, "a", *ASYNC, *cuda)
    assert a == _run(tmp_path, tiny_model_dir, "b", *ASYNC, *cuda)
    assert [a[s]["train/async/trajectory_age_mean"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]
    sync = _run(tmp_path, tiny_model_dir, "sync", *cuda)
    d0 = _run(tmp_path, tiny_model_dir, "d0", *ASYNC, *cuda, "grpo.async_grpo.max_trajectory_age_steps=0")
    for step, row in sync.items():
        assert {k: d0[step][k] for k in row} == row, f"step {step}: async d=0 differs from sync on CUDA"


@pytest.fixture(scope="module")
def killed_at_step_2(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A d = 1 run SIGKILLed the moment its step-2 checkpoint is published; tests resume copies of it."""
    run_dir = tmp_path_factory.mktemp("async_killed") / "run"
    argv = ["-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir)]
    sigkill_after_checkpoint(
        [*argv, *tiny_grpo_overrides(tiny_model_dir, *BASE, *ASYNC)], run_dir / "checkpoints" / "step_2"
    )
    return run_dir


def test_sigkill_with_rollouts_in_flight_resumes_exactly(tmp_path, tiny_model_dir, shared, killed_at_step_2):
    overrides = tiny_grpo_overrides(tiny_model_dir, *BASE, *ASYNC)
    reference, reference_dir = shared(*ASYNC)
    run_dir = tmp_path / "killed"
    shutil.copytree(killed_at_step_2, run_dir)
    saved = load_state_file(run_dir / "checkpoints" / "step_2" / ASYNC_STATE)
    # d = 1: after step 2, batch 3 (version 1) and batch 4 (version 2) were generated and not yet trained on
    assert [(b["index"], b["version"]) for b in saved["batches"]] == [(3, 1), (4, 2)]
    assert all(len(b["keys"]) == 16 for b in saved["batches"])
    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    # steps 1-2 of the killed process and 3-4 of the resumed one: what the uninterrupted run logged
    assert _metrics(run_dir) == reference
    # the flight recorder's files too, for the steps trained on batches that were in flight (sample keys are fresh
    # per run; every other column, the text included, is the same)
    for step in range(3, STEPS + 1):
        name = f"rollouts/step_{step:06d}.parquet"
        a, b = (pq.read_table(d / name).drop(["sample_key"]) for d in (reference_dir, run_dir))
        assert a.equals(b), f"recorded rollouts of step {step} differ after resume"


def test_sigkill_with_rollouts_in_flight_in_the_data_plane_checkpoint_resumes_exactly(tmp_path, tiny_model_dir, shared):
    """`checkpointing.save_data_plane=true`: the batches in flight stay in the checkpoint's data-plane store (their
    partitions, rows and claim cursors), the async state file keeps only their descriptions, and the resume after a
    SIGKILL logs what the uninterrupted run logs."""
    store = (*ASYNC, "checkpointing.save_data_plane=true")
    overrides = tiny_grpo_overrides(tiny_model_dir, *BASE, *store)
    reference, _ = shared(*ASYNC)  # where in-flight rows are kept changes no number
    run_dir = tmp_path / "killed"
    sigkill_after_checkpoint(
        ["-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides], run_dir / "checkpoints" / "step_2"
    )
    step_2 = run_dir / "checkpoints" / "step_2"
    saved = load_state_file(step_2 / ASYNC_STATE)
    assert saved["rows_in_store"] and [(b["index"], b["version"]) for b in saved["batches"]] == [(3, 1), (4, 2)]
    assert all("rows" not in b for b in saved["batches"])
    parts = {p["id"]: p["state"] for p in load_state_file(step_2 / "data_plane" / "store.safetensors")["partitions"]}
    for b in saved["batches"]:  # each batch's partition: its 16 keys, nobody's claim yet
        assert parts[b["partition_id"]]["keys"] == b["keys"] and len(b["keys"]) == 16
        assert not any(parts[b["partition_id"]]["consumed"].values())
    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    assert _metrics(run_dir) == reference  # steps 1-2 of the killed process, 3-4 of the resumed one
    assert (run_dir / "checkpoints" / f"step_{STEPS}" / "data_plane" / "manifest.json").is_file()


def test_sigkill_with_rollouts_in_flight_across_an_epoch_end(tmp_path, tiny_model_dir):
    """3 batches per epoch, 2 epochs: after step 2, batch 3 (epoch 0's last) and batch 4 (epoch 1's first) are in
    flight; the resumed run ends the epoch where the uninterrupted one did and logs the same metrics."""
    small = (
        "data.arithmetic.max_operand=13",  # 4 x 4 x 2 = 32 problems, 20 held out: 12 prompts, 3 batches of 4
        "data.arithmetic.num_val_problems=20",
        "grpo.max_num_epochs=2",
        "grpo.max_num_steps=100",
        "grpo.val_period=3",
    )
    overrides = tiny_grpo_overrides(tiny_model_dir, *BASE, *ASYNC, *small)
    reference = _run(tmp_path, tiny_model_dir, "uninterrupted", *ASYNC, *small)
    assert sorted(reference) == list(range(1, 7))
    run_dir = tmp_path / "killed"
    argv = ["-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides]
    sigkill_after_checkpoint(argv, run_dir / "checkpoints" / "step_2")
    saved = load_state_file(run_dir / "checkpoints" / "step_2" / ASYNC_STATE)
    assert [(b["index"], b["epoch"]) for b in saved["batches"]] == [(3, 0), (4, 1)]
    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    assert _metrics(run_dir) == reference


def test_resume_with_a_tighter_bound_drops_and_counts_stale_groups(tmp_path, tiny_model_dir, killed_at_step_2):
    """A checkpoint taken with d = 1 holds batches 3 (version 1) and 4 (version 2); resumed with d = 0, step 3 may
    only train on version-2 samples, so both batches are dropped (4 groups each), counted, and regenerated from the
    next prompts."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_at_step_2, run_dir)
    overrides = tiny_grpo_overrides(tiny_model_dir, *BASE, *ASYNC)
    tighter = [*overrides, "grpo.async_grpo.max_trajectory_age_steps=0"]
    assert main(["train", "--run-dir", str(run_dir), "--allow-inexact-resume", *tighter]) == 0
    resumed = _metrics(run_dir)
    assert resumed[3]["train/async/dropped_stale_groups"] == 8.0
    assert resumed[3]["train/async/trajectory_age_mean"] == 0.0
    assert resumed[3]["train/async/generating_weight_version"] == 2.0
    assert resumed[4]["train/async/dropped_stale_groups"] == 0.0


def test_no_key_outlives_its_step_or_the_run(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Every key the producer writes is trained on and cleared with its step, or discarded and counted at shutdown
    (here: an early stop at step 2's validation leaves batches 3 and 4 generated)."""
    from relayrl.algorithms.grpo_sync import GRPOSyncSteps

    held: list[int] = []
    partitions: list[list[str]] = []
    step, close = GRPOSyncSteps.step, GRPOSyncSteps.close

    def live_keys(steps: GRPOSyncSteps) -> int:
        if steps.source.producer._thread.is_alive():  # count once production is idle: no half-put batch
            steps.source.producer.drain()
        client = steps.policy.dp_client
        partitions.append(sorted(client.bytes_held()))
        return sum(len(client.keys(pid)) for pid in client.bytes_held())

    def step_and_count(self, batch, index):
        out = step(self, batch, index)
        held.append(live_keys(self))
        return out

    def close_and_count(self):
        close(self)
        held.append(live_keys(self))

    monkeypatch.setattr(GRPOSyncSteps, "step", step_and_count)
    monkeypatch.setattr(GRPOSyncSteps, "close", close_and_count)
    stop_early = ("grpo.stop_at_validation_metric=accuracy", "grpo.stop_at_validation_threshold=0.0")
    _run(tmp_path, tiny_model_dir, "leaks", *ASYNC, "grpo.async_grpo.max_trajectory_age_steps=2", *stop_early)
    # after step k the weights of version k allow batches up to k + 1 + d: batches 2-4 after step 1, 3-4 after step 2
    # (16 rows each; the run has 4), and nothing once the run ended
    assert held == [3 * 16, 2 * 16, 0]
    # a batch's partition is retired with its step: the store (and each metrics row) holds the batches ahead and the
    # validation partition, however long the run
    assert partitions == [["train_b2", "train_b3", "train_b4"], ["train_b3", "train_b4"], ["val"]]
    rows = [json.loads(x) for x in (tmp_path / "leaks" / "metrics.jsonl").read_text().splitlines()]
    assert max(sum(k.startswith("data_plane/held_bytes/") for k in r) for r in rows) <= 2 + 1 + 1
    out = capsys.readouterr().out
    assert "async: 2 generated batch(es) (8 groups) not trained on; discarded at shutdown" in out


def test_producer_death_ends_the_run_with_one_line(tmp_path, tiny_model_dir, monkeypatch, capsys):
    real = async_rollouts.RolloutProducer._generate

    def failing(self, index, batch, version):
        if index == 5:  # generated (d = 1, version 3) while step 4 trains; step 4's checkpoint drain finds it dead
            raise OSError("disk on fire")
        return real(self, index, batch, version)

    monkeypatch.setattr(async_rollouts.RolloutProducer, "_generate", failing)
    run_dir = tmp_path / "dies"
    overrides = tiny_grpo_overrides(tiny_model_dir, *BASE, *ASYNC, "grpo.max_num_steps=6")
    code = main(["train", "--run-dir", str(run_dir), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1] == (
        "relayrl: error: rollout producer died at batch 5 (OSError: disk on fire); "
        f"`relayrl train --run-dir {run_dir}` resumes from the last checkpoint"
    )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # step 4 trained and was logged; its checkpoint's drain found the producer dead, so a resume redoes steps 3-4
    assert max(r["step"] for r in rows if "train/loss" in r) == 4
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_2"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("data_plane.enabled=false",), "needs data_plane.enabled=true"),
        (("grpo.use_dynamic_sampling=true",), "use_dynamic_sampling"),
        (("grpo.async_grpo.in_flight_weight_updates=true",), "in_flight_weight_updates"),
        (("loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=8"), "force_on_policy_ratio"),
        (("cluster.executor=ray",), "policy.generation.colocated.enabled=false"),
        (("grpo.async_grpo.generator=thread", "grpo.async_grpo.generation_threads=2"), "generation_threads needs"),
    ],
)
def test_impossible_combinations_are_refused_in_one_line(tmp_path, tiny_model_dir, capsys, extra, needle):
    code = main(["train", "--run-dir", str(tmp_path / "r"), *tiny_grpo_overrides(tiny_model_dir, *ASYNC, *extra)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0]
    assert not (tmp_path / "r").exists()

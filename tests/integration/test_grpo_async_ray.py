"""Asynchronous GRPO on the Ray executor (issue 16): 2 training workers, dedicated generation workers, the `ray` store.

The producer generates batch k on the generation workers with weights version max(0, k - 1 - d), loaded from the
snapshot the trainer published, so the metrics depend neither on timing nor on how the rows are split across
generation workers: a run on 1 generation worker and one on 2, SIGKILLed after a checkpoint with batches in flight
and resumed, log identical metrics; with d = 0 the async trainer on Ray logs what the sync data-plane trainer logs.
No key outlives its step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from relayrl.algorithms.async_state import ASYNC_STATE
from relayrl.algorithms.grpo_sync import GRPOSyncSteps
from relayrl.algorithms.setup import run_training
from relayrl.utils.config_io import load_config
from relayrl.utils.state_file import load_state_file
from tests.helpers import metrics_by_step, sigkill_after_checkpoint

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 6  # 2 training + up to 2 generation workers (the shared `ray_cluster` fixture reads it)

STEPS = 4
ROWS = 16  # 4 prompts x 4 generations per batch


def overrides(*extra: str, gen_workers: int = 1) -> list[str]:
    """The shipped model (it earns rewards, so advantages and what staleness changes are not all zero)."""
    return [
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=4",
        "policy.generation.max_new_tokens=12",
        "policy.optimizer.kwargs.lr=1e-3",
        "loss_fn.reference_policy_kl_penalty=0.05",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        f"grpo.max_num_steps={STEPS}",
        "grpo.val_at_start=false",
        "grpo.val_period=2",
        "grpo.max_val_samples=4",
        "grpo.val_batch_size=4",
        "checkpointing.save_period=2",
        "logger.progress_bar=false",
        "logger.tensorboard_enabled=false",
        "cluster.executor=ray",
        "cluster.workers_per_node=2",
        "cluster.deterministic=true",
        "cluster.torch_num_threads=1",
        "data_plane.enabled=true",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.num_nodes=1",
        f"policy.generation.colocated.resources.workers_per_node={gen_workers}",
        *extra,
    ]


ASYNC = ("grpo.async_grpo.enabled=true",)


def _metrics(run_dir: Path) -> dict[int, dict]:
    """Per-step train/validation metrics; machine-dependent rates, timings and byte counters left out."""
    return metrics_by_step(run_dir, ("train/", "validation/"), skip=("per_sec", "bytes", "fraction", "timing"))


def on_local(args: list[str]) -> list[str]:
    """The same run on the local executor (2 rank threads, generation in the driver, the memory store)."""
    return [a for a in args if not a.startswith(("cluster.executor=", "policy.generation.colocated."))]


def _train(run_dir: Path, *extra: str, gen_workers: int = 1, local: bool = False) -> None:
    args = overrides(*extra, gen_workers=gen_workers)
    cfg = load_config(None, on_local(args) if local else args)
    assert cfg.data_plane.backend == ("memory" if local else "ray")
    os.environ["RELAYRL_REFIT_IPC_DIR"] = str(run_dir.parent)  # ZMQ IPC sockets private to this module
    try:
        run_training(cfg, run_dir)
    finally:
        os.environ.pop("RELAYRL_REFIT_IPC_DIR", None)


@contextmanager
def counting_live_keys(held: list[int]) -> Iterator[None]:
    """Record the keys alive in the store after every async step and after the trainer closed."""
    step, close = GRPOSyncSteps.step, GRPOSyncSteps.close

    def live(steps: GRPOSyncSteps) -> int:
        client = steps.policy.dp_client
        return sum(len(client.keys(pid)) for pid in client.bytes_held())

    def step_and_count(self, batch, index):  # type: ignore[no-untyped-def]
        out = step(self, batch, index)
        held.append(live(self))
        return out

    def close_and_count(self):  # type: ignore[no-untyped-def]
        close(self)
        held.append(live(self))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GRPOSyncSteps, "step", step_and_count)
        mp.setattr(GRPOSyncSteps, "close", close_and_count)
        yield


@pytest.fixture(scope="module")
def runs(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[int, dict]]:
    """Each named run once per module (tests compare them); `held` gets the live-key counts of the first async run."""
    cache: dict[str, dict[int, dict]] = {}
    root = tmp_path_factory.mktemp("async_ray")
    held: list[int] = []

    def get(name: str, *extra: str, gen_workers: int = 1, local: bool = False) -> dict[int, dict]:
        if name not in cache:
            if name == "a":
                with counting_live_keys(held):
                    _train(root / name, *extra, gen_workers=gen_workers)
            else:
                _train(root / name, *extra, gen_workers=gen_workers, local=local)
            cache[name] = _metrics(root / name)
        return cache[name]

    get.held = held  # type: ignore[attr-defined]
    get.root = root  # type: ignore[attr-defined]
    return get


def test_age_one_on_ray_is_off_policy(runs) -> None:
    """Determinism (a second run of the seed, on two generation workers, logs the same numbers) is checked by the
    SIGKILL test below, whose killed-and-resumed run is that second run."""
    a = runs("a", *ASYNC)
    assert sorted(s for s, m in a.items() if "train/loss" in m) == list(range(1, STEPS + 1))
    assert [a[s]["train/async/generating_weight_version"] for s in range(1, STEPS + 1)] == [0.0, 0.0, 1.0, 2.0]
    assert [a[s]["train/async/trajectory_age_mean"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]
    assert a[STEPS]["train/sampling_importance_ratio"] != 1.0  # stale samples: pi_old recomputed, IS weight != 1
    assert any(a[s]["train/reward"] > 0 for s in range(1, STEPS + 1))
    assert "validation/accuracy" in a[2] and "validation/accuracy" in a[4]


def test_age_zero_on_ray_reproduces_the_sync_trainer(runs) -> None:
    """The sync data-plane trainer logs the same numbers on both executors (tests/integration/test_ray_trainers.py,
    bit for bit), so its run here is a local one: d = 0 on Ray must log what it logs."""
    sync = runs("sync", local=True)
    d0 = runs("d0", *ASYNC, "grpo.async_grpo.max_trajectory_age_steps=0")
    assert sorted(sync) == sorted(d0)
    for step, row in sync.items():
        assert {k: d0[step][k] for k in row} == row, f"step {step}: async d=0 differs from sync on Ray"
    assert [d0[s]["train/async/generating_weight_version"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 2.0, 3.0]


def test_no_key_outlives_its_step_or_the_run(runs) -> None:
    runs("a", *ASYNC)
    held = runs.held
    assert len(held) == STEPS + 1
    assert held[-1] == 0  # nothing left in the Ray store once the trainer closed
    assert all(n <= 2 * ROWS for n in held[:-1])  # at most the next d + 1 = 2 batches, never a trained one


def test_sigkill_after_a_checkpoint_with_batches_in_flight_resumes_exactly(runs, monkeypatch) -> None:
    """The driver SIGKILLed the moment the step-2 checkpoint (which holds batches 3 and 4, generated and not trained
    on) is published, its Ray processes with it; the next start in the same run directory restores their rows into
    a fresh Ray store and logs the uninterrupted metrics. This run generates on two workers, the uninterrupted one
    on one: one comparison for run-to-run determinism, the generation-worker count and the exact resume (each was a
    run of its own; a difference in steps 1-2 is determinism or the worker count, in 3-4 also the resume)."""
    reference = runs("a", *ASYNC)
    run_dir = runs.root / "killed"
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(runs.root))
    # the killed driver joins this module's cluster as `ray job submit` would have it join (RAY_ADDRESS); Ray ends
    # its actors when it dies, and the resume below runs on the same cluster
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    argv = ["-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides(*ASYNC, gen_workers=2)]
    sigkill_after_checkpoint(argv, run_dir / "checkpoints" / "step_2")
    saved = load_state_file(run_dir / "checkpoints" / "step_2" / ASYNC_STATE)
    assert [(b["index"], b["version"]) for b in saved["batches"]] == [(3, 1), (4, 2)]
    assert all(len(b["keys"]) == ROWS for b in saved["batches"])
    _train(run_dir, *ASYNC, gen_workers=2)
    resumed = _metrics(run_dir)
    for step in range(1, STEPS + 1):
        assert resumed[step] == reference[step], f"step {step}: 2 generation workers (resumed after step 2) differ"
    for step in (3, 4):  # the flight recorder's rows of the batches that were in flight (keys are fresh per run)
        name = f"rollouts/step_{step:06d}.parquet"
        a, b = (pq.read_table(d / name).drop(["sample_key"]) for d in (runs.root / "a", run_dir))
        assert a.num_rows == ROWS and a.equals(b), f"recorded rollouts of step {step} differ after resume"

"""Asynchronous GRPO on the local executor over the Ray-hosted data-plane backends (`ray`, `transfer_queue`): the
producer thread writes through its own client while the trainer claims, reads and clears through the policy's, so
the runs must log what the memory backend's log, d = 0 must be the sync trainer on the same backend, no key may
outlive the run (in the ledger or in TransferQueue's own storage), and a SIGKILL with batches in flight resumes
exactly."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from relayrl.algorithms.async_state import ASYNC_STATE
from relayrl.cli.main import main
from relayrl.utils.state_file import load_state_file
from tests.helpers import sigkill_after_checkpoint, tiny_grpo_overrides
from tests.integration.test_grpo_async import BASE, STEPS, _metrics, _run

pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 4  # the shared `ray_cluster` fixture (tests/conftest.py) reads it; TransferQueue takes 3

BACKENDS = pytest.mark.parametrize("backend", ["ray", "transfer_queue"])
#: The producer's engine in its thread: the generation process returns tokens to the producer thread, which writes
#: them through its client either way (test_grpo_async checks that both engines sample the same), and starting one
#: per run costs more than these runs take.
ASYNC = ("grpo.async_grpo.enabled=true", "grpo.async_grpo.generator=thread")

_d1_runs: dict[str, tuple[dict[int, dict], Path]] = {}
"""The uninterrupted d = 1 run's metrics and run directory per backend, shared by the determinism and the resume
test."""


_memory_run: dict[str, dict[int, dict]] = {}
"""The d = 1 run on the memory backend, which both Ray-hosted backends must match."""


def _on(backend: str, *extra: str) -> tuple[str, ...]:
    return (f"data_plane.backend={backend}", *extra)


def _tq_keys() -> int:
    """Keys TransferQueue itself still holds (its controller's listing, independent of relayrl's ledger)."""
    import transfer_queue as tq

    return sum(len(keys) for keys in tq.kv_list().values())


@BACKENDS
def test_age_zero_reproduces_the_sync_trainer_on_the_same_backend(tmp_path, tiny_model_dir, ray_cluster, backend):
    sync = _run(tmp_path, tiny_model_dir, "sync", *_on(backend))
    d0 = _run(tmp_path, tiny_model_dir, "d0", *ASYNC, *_on(backend, "grpo.async_grpo.max_trajectory_age_steps=0"))
    assert sorted(d0) == list(range(1, STEPS + 1))
    for step, row in sync.items():
        assert {k: d0[step][k] for k in row} == row, f"step {step}: async d=0 on {backend} differs from sync"


@BACKENDS
def test_age_one_is_deterministic_and_matches_the_memory_backend(tmp_path, tiny_model_dir, ray_cluster, backend):
    """Run-to-run determinism on the backend: the SIGKILL test's killed-and-resumed run logs what this one does."""
    a = _run(tmp_path, tiny_model_dir, "a", *ASYNC, *_on(backend))
    assert [a[s]["train/async/trajectory_age_mean"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]
    # the store moves bytes, never numbers: the same run on the in-process store logs the same metrics
    if "memory" not in _memory_run:  # one memory run serves both backends
        _memory_run["memory"] = _run(tmp_path, tiny_model_dir, "memory", *ASYNC, *_on("memory"))
    assert _memory_run["memory"] == a
    _d1_runs[backend] = a, tmp_path / "a"


@BACKENDS
def test_no_key_outlives_its_step_or_the_run(tmp_path, tiny_model_dir, ray_cluster, backend, monkeypatch, capsys):
    """Every key the producer writes through its own client is trained on and cleared with its step, or discarded
    and counted at shutdown (an early stop at step 2 leaves batches 3 and 4 generated); TransferQueue's storage
    empties with the ledger."""
    from relayrl.algorithms.grpo_sync import GRPOSyncSteps

    held: list[tuple[int, int]] = []
    step, close = GRPOSyncSteps.step, GRPOSyncSteps.close

    def live_keys(steps: GRPOSyncSteps) -> tuple[int, int]:
        if steps.source.producer._thread.is_alive():
            steps.source.producer.drain()  # production idle: the two listings cannot see a half-put batch
        client = steps.policy.dp_client
        ledger = sum(len(client.keys(pid)) for pid in client.bytes_held())
        return ledger, _tq_keys() if backend == "transfer_queue" else ledger

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
    _run(tmp_path, tiny_model_dir, "leaks", *ASYNC, *_on(backend, "grpo.async_grpo.max_trajectory_age_steps=2"),
         *stop_early)  # fmt: skip
    # batches 2-4 after step 1, 3-4 after step 2 (what versions 1 and 2 allow with d = 2), nothing at the end; TQ's
    # own storage agrees with the ledger every time
    assert held == [(3 * 16, 3 * 16), (2 * 16, 2 * 16), (0, 0)]
    out = capsys.readouterr().out
    assert "async: 2 generated batch(es) (8 groups) not trained on; discarded at shutdown" in out


@BACKENDS
def test_sigkill_with_rollouts_in_flight_resumes_exactly(tmp_path, tiny_model_dir, ray_cluster, backend, monkeypatch):
    """On the `ray` store the killed run joins this module's cluster (RAY_ADDRESS, as a `ray job submit` driver
    would; its store is named by its job); on TransferQueue it starts its own Ray, as the CLI does for a Ray-hosted
    store on the local executor (TransferQueue's controller name is fixed per cluster, and the killed run's keeps it
    until Ray notices its driver died). The resumed run writes the checkpoint's in-flight rows back into a fresh
    store through the producer's client. Steps 1-2 of the killed process and 3-4 of the resumed one log what the
    uninterrupted run logs (run-to-run determinism on the backend too)."""
    import ray

    if backend == "ray":
        monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    overrides = tiny_grpo_overrides(tiny_model_dir, *BASE, *ASYNC, *_on(backend))
    if backend in _d1_runs:
        reference, reference_dir = _d1_runs[backend]
    else:
        reference_dir = tmp_path / "uninterrupted"
        reference = _run(tmp_path, tiny_model_dir, reference_dir.name, *ASYNC, *_on(backend))
    run_dir = tmp_path / "killed"
    argv = ["-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir), *overrides]
    sigkill_after_checkpoint(argv, run_dir / "checkpoints" / "step_2")
    saved = load_state_file(run_dir / "checkpoints" / "step_2" / ASYNC_STATE)
    assert [(b["index"], b["version"]) for b in saved["batches"]] == [(3, 1), (4, 2)]
    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    resumed = _metrics(run_dir)
    assert sorted(resumed) == sorted(reference) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == reference[step], f"step {step} differs from the uninterrupted run on {backend}"
    for step in range(3, STEPS + 1):
        # the flight recorder reads the restored rows back from the store: same files (sample keys are per run)
        name = f"rollouts/step_{step:06d}.parquet"
        a, b = (pq.read_table(d / name).drop(["sample_key"]) for d in (reference_dir, run_dir))
        assert a.equals(b), f"recorded rollouts of step {step} differ after resume on {backend}"

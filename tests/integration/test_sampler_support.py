"""`train/sampling/support_*` end to end: the sampler's kept sets travel with the rollout on the legacy trainer, the
data-plane trainer (a store field) and asynchronous GRPO (the producer's generation process), and the counter
sees staleness: zero at an on-policy float32 step, non-zero on batches one version old."""

from __future__ import annotations

from pathlib import Path

from relayrl.cli.main import main
from tests.helpers import EXACT_RUN, metrics_by_step, tiny_grpo_overrides

MISMATCH = "train/sampling/support_mismatch"
BASE = (*EXACT_RUN, "policy.generation.top_k=3", "grpo.val_period=0", "grpo.val_at_start=false")


def _run(tmp_path: Path, model: Path, name: str, *extra: str) -> dict[int, dict]:
    run_dir = tmp_path / name
    assert main(["train", "--run-dir", str(run_dir), *tiny_grpo_overrides(model, *BASE, *extra)]) == 0
    return metrics_by_step(run_dir, ("train/sampling/",))


def test_async_age_one_counts_support_mismatches_only_on_stale_batches(tmp_path, tiny_model_dir):
    # the shipped model earns rewards from step 1, so the update between versions is not zero
    shipped = ("policy.model_name=builtin:tiny-arith", "policy.generation.max_new_tokens=16")
    on_async = ("grpo.async_grpo.enabled=true", "grpo.async_grpo.generator=thread")  # no generation process to start
    runs = _run(tmp_path, tiny_model_dir, "async", *shipped, "grpo.max_num_steps=2", *on_async)
    assert [runs[s][MISMATCH] == 0 for s in (1, 2)] == [True, False]  # batch 1: the weights it trains
    assert all(runs[s]["train/sampling/support_unrecorded"] == 0 for s in (1, 2))


def test_both_trainers_count_the_same_bf16_support_mismatches(tmp_path, tiny_model_dir):
    bf16 = ("grpo.max_num_steps=2", "policy.precision=bfloat16")
    store = _run(tmp_path, tiny_model_dir, "data_plane", *bf16)
    assert store == _run(tmp_path, tiny_model_dir, "legacy", *bf16, "data_plane.enabled=false")
    assert sum(row[MISMATCH] for row in store.values()) > 0

"""`relayrl train` with sequence packing or dynamic batching, end to end on both trainers: the legacy trainer and the
data-plane trainer plan the same micro-batches (one planner, `models.microbatch.plan_rows`) and log identical
per-step metrics (`relayrl parity`), GRPO and PPO, two local data-parallel workers. That each mode changes no result
against an unpacked run is tested on the façades (tests/unit/models/test_packing_equivalence.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from relayrl.cli.main import main
from relayrl.models import microbatch
from tests.helpers import tiny_grpo_overrides, tiny_ppo_overrides

RUN = ("policy.optimizer.kwargs.lr=1e-3", "logger.tensorboard_enabled=false", "cluster.workers_per_node=2")


def keys(section: str, mode: str) -> list[str]:
    block = "sequence_packing" if mode == "packing" else "dynamic_batching"
    extra = [f"{section}.{block}.sequence_length_round=8"] if mode == "dynamic" else []
    return [f"{section}.{block}.{k}" for k in ("enabled=true", "train_mb_tokens=64", "logprob_mb_tokens=64")] + extra


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, int | None]]:
    """Counts the planner's calls by mode and chunk size (None: an inference pass; a global batch size: training)."""
    calls: Counter[tuple[str, int | None]] = Counter()
    plan_rows = microbatch.plan_rows

    def spy(lengths: list[int], dp: int, batch_size: int | None, args: Any) -> Any:
        calls[("packing" if args[0] is not None else "dynamic", batch_size)] += 1
        return plan_rows(lengths, dp, batch_size, args)

    monkeypatch.setattr(microbatch, "plan_rows", spy)
    return calls


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_grpo_trainers_agree_with_packing(tmp_path, tiny_model_dir, capsys, planned, mode) -> None:
    args = ["parity", "--steps", "2", "--tolerance", "0", "--out", str(tmp_path)]
    code = main([*args, *tiny_grpo_overrides(tiny_model_dir, *RUN, *keys("policy", mode))])
    out = capsys.readouterr().out
    assert code == 0 and "parity OK" in out, out
    # both trainers, 2 steps: the reference pass (no batch size; an on-policy step skips the previous-policy pass)
    # and training (global batches of 16)
    assert planned[(mode, None)] >= 2 * 2 and planned[(mode, 16)] == 2 * 2, planned


def test_ppo_trainers_agree_with_packing(tmp_path, tiny_model_dir, capsys, planned) -> None:
    """Policy and critic packed; with two workers GAE whitening sums float64 moments over the shards, so the two
    trainers agree to float32 rounding of the advantages, as without packing (test_parity.py)."""
    args = ["parity", "--steps", "2", "--tolerance", "1e-5", "--out", str(tmp_path)]
    extra = (*RUN, "value.optimizer.kwargs.lr=1e-3", "value_loss_fn.value_clip=0.2", "checkpointing.enabled=false")
    code = main(
        [*args, *tiny_ppo_overrides(tiny_model_dir, *extra, *keys("policy", "packing"), *keys("value", "packing"))]
    )
    out = capsys.readouterr().out
    assert code == 0 and "parity OK" in out, out
    assert planned[("packing", 8)] >= 2 * 2 * 2  # both trainers, both models' training, every step

"""pass@k of validation: the unbiased estimator 1 - C(n-c,k)/C(n,k), checked against known values, and what
`_validate_batches` reports with and without `val_pass_k`."""

from __future__ import annotations

from math import comb

import pytest
import torch

from relayrl.algorithms.validation import _validate_batches, pass_at_k
from relayrl.config import MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict


def test_known_values() -> None:
    passed = torch.tensor(
        [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool
    )  # n = 4, c = 0..4
    assert pass_at_k(passed, 2).tolist() == pytest.approx([0.0, 0.5, 5 / 6, 1.0, 1.0])
    assert pass_at_k(passed, 1).tolist() == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])  # pass@1 = c / n
    assert pass_at_k(passed, 4).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]  # k = n: any passed, exactly


def test_matches_the_binomial_formula() -> None:
    g = torch.Generator().manual_seed(0)
    passed = torch.rand(50, 8, generator=g) > 0.7
    for k in range(1, 9):
        want = [1 - comb(8 - int(c), k) / comb(8, k) for c in passed.sum(1)]
        assert pass_at_k(passed, k).tolist() == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(passed, 9)


@pytest.mark.parametrize(("pass_k", "want"), [(None, 0.5), (4, 0.5), (2, (0.0 + 0.5) / 2), (1, (0.0 + 0.25) / 2)])
def test_validation_reports_pass_k(pass_k: int | None, want: float) -> None:
    cfg = MasterConfig.model_validate(
        {"grpo": {"val_num_generations_per_prompt": 4, "val_pass_k": pass_k, "max_val_samples": 2, "val_batch_size": 2}}
    )
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])  # prompt 1: none pass; prompt 2: one of four

    def rollout(batch: BatchedDataDict) -> tuple[torch.Tensor, float, list[dict[str, object]]]:
        assert batch.size == 8
        return rewards, 3.0, []

    loader = [BatchedDataDict({"idx": torch.arange(2)})]
    metrics, _ = _validate_batches(loader, rollout, 0, cfg, None)  # type: ignore[arg-type]
    assert metrics["pass_k"] == pytest.approx(want) and metrics["accuracy"] == pytest.approx(1 / 8)

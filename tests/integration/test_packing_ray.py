"""Sequence packing and dynamic batching on the Ray executor: two Ray workers (gloo) give the unpacked one-worker
results within float32 rounding (tolerances derived in tests/unit/models/packing_runs.py) for GRPO's and PPO's policy
updates and PPO's critic, on the legacy façades and on the data plane (ray backend); under DDP and FSDP2 (whose
sharded weights take HF's forward on one packed row with a block-diagonal mask) too. Ranks whose own plans differ in
micro-batch count stay in step under DDP (zero-loss replays), where a missing forward/backward would hang the
gradient all-reduce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig, DataPlaneConfig
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.worker import PolicyWorker
from tests.helpers import EPS_F32, f32_tol, trained_weight_tol
from tests.unit.models import packing_runs as runs

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 4  # the shared `ray_cluster` fixture (tests/conftest.py) reads it


@pytest.fixture(scope="module", autouse=True)
def _own_ray(ray_cluster: None) -> None:
    """This module's Ray, shut down at its end (a Ray left running would be reused, too small, by later modules)."""


DP_CFG = DataPlaneConfig(enabled=True, backend="ray", storage_capacity=10_000)
RAY = dict(executor="ray", workers_per_node=2, torch_num_threads=1, device="cpu")
HIDDEN = 64


def run(kind: str, model: str, model_dir: Path, tokenizer: Any, mode: str, batch: BatchedDataDict, cluster: Any) -> Any:
    built = runs.build(kind, model, model_dir, tokenizer, mode, cluster, DP_CFG)
    try:
        if model == "value":
            return runs.run_value(built, batch)
        return runs.run_policy(built, batch, batch.get("ppo_advantages"))
    finally:
        built.shutdown()


@pytest.fixture(scope="module")
def reference(char_tokenizer: Any, tiny_model_dir: Path) -> dict[str, Any]:
    """Batches and the unpacked one-worker (local) runs they are compared with."""
    grpo = runs.make_batch(len(char_tokenizer))
    local = ClusterConfig(device="cpu")
    value = run("legacy", "value", tiny_model_dir, char_tokenizer, "unpacked", grpo, local)
    ppo = BatchedDataDict({**grpo, "ppo_advantages": runs.ppo_advantages(grpo, value.passes["values"])})
    policy = run("legacy", "policy", tiny_model_dir, char_tokenizer, "unpacked", grpo, local)
    actor = run("legacy", "policy", tiny_model_dir, char_tokenizer, "unpacked", ppo, local)
    return {"batches": {"grpo": grpo, "ppo": ppo, "value": grpo}, "grpo": policy, "ppo": actor, "value": value}


def check(report: dict[str, tuple[float, float]]) -> None:
    for name, (diff, tol) in report.items():
        assert diff <= tol, f"{name}: |difference| {diff:.3g} > tolerance {tol:.3g}"
        if name.startswith(("loss", "grad_norm", "weights", "mb_loss")):
            assert tol <= 1e-5, f"{name}: the derived tolerance {tol:.3g} misses the 1e-5 target"


@pytest.mark.parametrize(
    ("algo", "kind", "mode"),
    [
        # each façade (legacy, data plane), model (policy, critic) and mode (packing, dynamic batching) on Ray at
        # least once, and PPO's actor update: every combination runs on 2 local ranks in
        # tests/unit/models/test_packing_equivalence.py (the same worker code); what Ray adds is the transport
        ("grpo", "tq", "packing"),
        ("grpo", "legacy", "dynamic"),
        ("value", "legacy", "packing"),
        ("value", "tq", "dynamic"),
        ("ppo", "tq", "packing"),
    ],
)
def test_two_ray_workers_equal_the_unpacked_run(
    algo: str, kind: str, mode: str, reference: dict[str, Any], char_tokenizer: Any, tiny_model_dir: Path
) -> None:
    model = "value" if algo == "value" else "policy"
    batch = reference["batches"][algo]
    # a data-plane critic attaches to the named store actor a run's TQPolicy starts: start it here
    store = build_data_plane_client(DP_CFG, bootstrap=True) if (kind, model) == ("tq", "value") else None
    try:
        got = run(kind, model, tiny_model_dir, char_tokenizer, mode, batch, ClusterConfig(**RAY))  # type: ignore[arg-type]
    finally:
        if store is not None:
            store.close()
    if algo == "ppo":
        batch = BatchedDataDict({**batch, "advantages": batch["ppo_advantages"]})
    check(runs.compare(got, reference[algo], batch, model, vocab=len(char_tokenizer), hidden=HIDDEN))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_packing_under_ddp_and_fsdp2(
    strategy: str, reference: dict[str, Any], char_tokenizer: Any, tiny_model_dir: Path
) -> None:
    batch = reference["batches"]["grpo"]
    cfg = runs.policy_config(tiny_model_dir, "packing", data_parallel={"strategy": strategy})
    policy = Policy(cfg, char_tokenizer, cluster=ClusterConfig(**RAY))  # type: ignore[arg-type]
    try:
        got = runs.run_policy(policy, batch)
    finally:
        policy.shutdown()
    check(runs.compare(got, reference["grpo"], batch, "policy", vocab=len(char_tokenizer), hidden=HIDDEN))


def test_ranks_with_unequal_plans_stay_in_step_under_ddp(
    reference: dict[str, Any], char_tokenizer: Any, tiny_model_dir: Path
) -> None:
    """Each rank plans its own rows (no driver plan): the long rows give rank 0 two bins, the short ones rank 1 one;
    DDP needs every rank in every forward/backward, so rank 1 replays its bin with zero loss. The step equals the
    manual strategy's, which needs no replays."""
    batch = reference["batches"]["grpo"].copy()
    batch["prev_logprobs"] = reference["grpo"].passes["logprobs"]
    batch["reference_policy_logprobs"] = reference["grpo"].passes["reference"]
    order = batch["input_lengths"].argsort(descending=True)
    shards = [batch.select_indices(order[:4]), batch.select_indices(order[4:])]  # 120, 88, 57, 31 | 14, 9, 4, 3
    results = {}
    for strategy in ("manual", "ddp"):
        cfg = runs.policy_config(tiny_model_dir, "packing", data_parallel={"strategy": strategy})
        policy = Policy(cfg, char_tokenizer, cluster=ClusterConfig(**RAY))  # type: ignore[arg-type]
        try:
            out = policy._group.run_sharded(PolicyWorker.train, shards, runs.pg_loss(), False, runs.GBS, runs.MBS)
            results[strategy] = (out, {k: v.clone() for k, v in policy.state_dict().items()})
        finally:
            policy.shutdown()
    (manual, w_manual), (ddp, w_ddp) = results["manual"], results["ddp"]
    n_tok = int(runs.global_counts(batch, 1)[1])
    gn, params = float(manual[0]["grad_norm"]), sum(w.numel() for w in w_manual.values())
    assert abs(float(ddp[0]["grad_norm"]) - gn) <= runs.norm_tol(gn, n_tok, params)
    # the same micro-batches on the same ranks: the loss is the same sum, only the gradients are reduced otherwise
    loss = float(manual[0]["loss"].abs().max())
    scale = 2 * float(batch["advantages"].abs().max())
    assert (manual[0]["loss"] - ddp[0]["loss"]).abs().max() <= f32_tol(scale / n_tok, n_tok) + EPS_F32 * loss
    assert len(ddp[0]["all_mb_metrics"]["loss"]) == 2  # two bins on rank 0 ...
    assert len(ddp[1]["all_mb_metrics"]["loss"]) == 1  # ... one on rank 1, whose replay is not recorded
    grad_tol = f32_tol(runs.MAX_GRAD_NORM, n_tok)
    tol = trained_weight_tol(w_manual, grad_tol=grad_tol, lr=runs.LR, steps=1, eps=runs.ADAM_EPS)
    assert max(float((w_ddp[k] - w).abs().max()) for k, w in w_manual.items()) <= tol
    assert torch.equal(ddp[0]["loss"], ddp[1]["loss"])  # both ranks finished the same all-reduced step

"""Data-parallel policy training on the Ray executor (gloo) against one local worker with the same global batch.

`RayPolicy` is `Policy` with the proposed two-line change to `lm_policy.py` applied: its workers are built by
`build_worker_group`, so on `cluster.executor="ray"` each rank is an actor whose `PolicyWorker` talks to its peer
through a `TorchDistCollective`. Everything else (sharding, reassembly, metric merging) is `Policy`'s own code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.config import ClippedPGLossConfig, ClusterConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.executor import build_worker_group, world_size
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.worker import PolicyWorker

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

B, S = 8, 12
LENGTHS = torch.tensor([12, 5, 7, 2, 12, 9, 3, 10])  # ragged, right-padded
TOL = 1e-5


class RayPolicy(Policy):
    """`Policy` whose worker group comes from `build_worker_group` (the change proposed for lm_policy.py)."""

    def __init__(self, config: PolicyConfig, tokenizer: Any, *, cluster: ClusterConfig) -> None:
        self.cfg = config
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.has_reference = True
        self.dp_size = world_size(cluster)
        self._group = build_worker_group(
            PolicyWorker,
            cluster,
            config=config,
            tokenizer=tokenizer,
            device=cluster.device,
            init_reference_model=True,
            init_optimizer=True,
            weights_path=None,
            optimizer_path=None,
            max_num_steps=None,
        )


def make_config(model_dir: Path) -> PolicyConfig:
    return PolicyConfig.model_validate(
        dict(
            model_name=str(model_dir),
            train_global_batch_size=4,
            train_micro_batch_size=2,
            max_grad_norm=1.0,
            optimizer={"kwargs": {"lr": 1e-2}},
        )
    )


def make_batch(vocab: int, seed: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (B, S), generator=g)  # [B, S]
    real = torch.arange(S)[None, :] < LENGTHS[:, None]  # [B, S]
    token_mask = real.float()
    token_mask[:, :3] = 0.0  # a "prompt" the loss ignores
    return BatchedDataDict(
        input_ids=ids.masked_fill(~real, 0),
        input_lengths=LENGTHS.clone(),
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 1]),
        advantages=torch.randn(B, 1, generator=g).expand(B, S).clone(),
    )


def rl_batch(policy: Policy, data: BatchedDataDict) -> BatchedDataDict:
    """Add the keys ClippedPGLossFn reads, computed by the policy itself (sharded across its ranks)."""
    lp = policy.get_logprobs(data)["logprobs"]
    data = data.copy()
    data["prev_logprobs"] = lp
    data["generation_logprobs"] = lp + 0.01 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    return data


def run(policy: Policy, vocab: int) -> dict[str, Any]:
    """Two train() calls (each: two global batches of 4 rows) and the logprobs afterwards."""
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.01))
    data = rl_batch(policy, make_batch(vocab))
    first = policy.train(data, loss_fn)
    second = policy.train(rl_batch(policy, make_batch(vocab, seed=1)), loss_fn)
    return {
        "prev_logprobs": data["prev_logprobs"],
        "reference": data["reference_policy_logprobs"],
        "results": (first, second),
        "weights": {k: v.detach().clone() for k, v in policy.state_dict_for_refit().items()},
        "logprobs": policy.get_logprobs(data)["logprobs"],
        "version": policy.weights_version,
    }


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_two_ray_workers_match_one_local_worker(ray_cluster: None, tiny_model_dir: Path, char_tokenizer) -> None:
    vocab = len(char_tokenizer)
    cfg = make_config(tiny_model_dir)
    local = Policy(cfg, char_tokenizer, cluster=ClusterConfig(workers_per_node=1))
    ref = run(local, vocab)
    local.shutdown()

    cluster = ClusterConfig(executor="ray", workers_per_node=2, torch_num_threads=1)
    policy = RayPolicy(cfg, char_tokenizer, cluster=cluster)
    group = policy._group
    try:
        assert group.world_size == 2 and policy.dp_size == 2
        out = run(policy, vocab)
    finally:
        policy.shutdown()

    # logprob passes sharded over 2 ranks come back in input order and equal the 1-worker result
    assert (out["prev_logprobs"] - ref["prev_logprobs"]).abs().max() <= TOL
    assert (out["reference"] - ref["reference"]).abs().max() <= TOL
    for r1, r2 in zip(ref["results"], out["results"]):
        assert r1["loss"].shape == r2["loss"].shape == (2,)  # one global-batch loss per optimizer step
        assert torch.allclose(r1["loss"], r2["loss"], atol=TOL, rtol=0)
        assert abs(float(r1["grad_norm"]) - float(r2["grad_norm"])) <= TOL
        assert r1["num_valid_seqs"] == r2["num_valid_seqs"] and r1["num_valid_tokens"] == r2["num_valid_tokens"]
        # per-micro-batch partial sums from both ranks add up to the mean global-batch loss
        assert sum(r2["all_mb_metrics"]["loss"]) == pytest.approx(float(r1["loss"].mean()), abs=TOL)
        assert len(r2["all_mb_metrics"]["loss"]) == len(r1["all_mb_metrics"]["loss"])
    assert out["version"] == ref["version"] == 4
    assert ref["weights"].keys() == out["weights"].keys()
    worst = max(float((ref["weights"][k] - out["weights"][k]).abs().max()) for k in ref["weights"])
    print(
        f"max |dw|={worst:.3g} loss1={ref['results'][0]['loss'].tolist()} loss2={out['results'][0]['loss'].tolist()} gn={float(ref['results'][1]['grad_norm'])},{float(out['results'][1]['grad_norm'])} lp={float((out['logprobs'] - ref['logprobs']).abs().max()):.3g}"
    )
    assert worst <= TOL, f"weights differ by {worst}"
    assert any(not torch.equal(ref["weights"][k], v) for k, v in PolicyWorker(cfg).model.state_dict().items())
    assert (out["logprobs"] - ref["logprobs"]).abs().max() <= TOL

    # shutdown released every actor process and the placement group
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{p}") for p in group.pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in group.pids)
    assert ray.util.placement_group_table()[group.placement_group_id]["state"] == "REMOVED"

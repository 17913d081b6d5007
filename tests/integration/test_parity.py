"""`relayrl parity`: the legacy and the data-plane trainer log identical per-step metrics (memory backend, CPU,
deterministic mode), with dynamic sampling on and off."""

from __future__ import annotations

import pytest
import torch

from relayrl.cli.main import main
from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from relayrl.environments.registry import ENV_REGISTRY, register_env
from relayrl.utils.jsonl import read_jsonl
from tests.helpers import tiny_grpo_overrides, tiny_ppo_overrides


class ParityEnv(EnvironmentInterface):
    """Deterministic, varied rewards from a random model: 1 when the response has an even number of characters."""

    def step(self, message_log_batch, metadata):
        rewards = []
        for log in message_log_batch:
            text = "".join(m["content"] for m in log if m["role"] == "assistant")
            rewards.append(float(len(text) % 2 == 0))
        n = len(message_log_batch)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "ok"}] * n,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards),
            terminateds=torch.ones(n, dtype=torch.bool),
        )


@pytest.fixture(scope="module", autouse=True)
def _parity_env():
    if "parity_test" not in ENV_REGISTRY:
        register_env("parity_test", lambda cfg: ParityEnv())
    yield
    ENV_REGISTRY.pop("parity_test", None)


#: added to tests.helpers.tiny_grpo_overrides: a real lr and the even-length reward above
GRPO_RUN = (
    "policy.optimizer.kwargs.lr=1e-3",
    "data.train.default_task=parity_test",
    "logger.tensorboard_enabled=false",
)


@pytest.mark.parametrize("dynamic_sampling", [False, True], ids=["ds_off", "ds_on"])
def test_parity_is_exact_on_memory_backend(tmp_path, tiny_model_dir, capsys, dynamic_sampling):
    extra = ["grpo.use_dynamic_sampling=true", "grpo.use_leave_one_out_baseline=false"] if dynamic_sampling else []
    code = main(
        ["parity", "--steps", "3", "--out", str(tmp_path), *tiny_grpo_overrides(tiny_model_dir, *GRPO_RUN, *extra)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "parity OK" in out and "train/loss" in out and "train/reward" in out and "validation/accuracy" in out
    if dynamic_sampling:
        assert "train/dynamic_sampling_num_gen_batches" in out


def test_parity_detects_a_difference(tmp_path):
    from relayrl.algorithms.parity import compare_runs

    for name, loss in (("legacy", 0.5), ("data_plane", 0.25)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(f'{{"step": 1, "train/loss": {loss}, "timing/train/x": 1}}\n')
    report = compare_runs(tmp_path / "legacy", tmp_path / "data_plane")
    assert report["max_abs_diff"] == {"train/loss": 0.25} and report["missing"] == []


#: added to tests.helpers.tiny_ppo_overrides: the critic's lr and value clip, the KL in the reward, the NLL on positive
#: examples (the data-plane policy reads its rewards from the store) and the parity_test task.
PPO_RUN = (
    "value.optimizer.kwargs.lr=1e-3",
    "value_loss_fn.value_clip=0.2",
    "loss_fn.use_kl_in_reward=true",
    "loss_fn.positive_example_nll_weight=0.5",
    "data.train.default_task=parity_test",
    "checkpointing.enabled=false",
)


@pytest.mark.parametrize("workers", [1, 2], ids=["dp1_exact", "dp2_sharded_gae"])
def test_ppo_parity_on_memory_backend(tmp_path, tiny_model_dir, capsys, workers):
    """Legacy `ppo_train` vs `ppo_train_sync`: identical rewards, policy and critic losses, KL, grad norms,
    explained variance and validation, with the KL in the reward (GAE reads both logprob columns) and a warm-up.
    One worker is exact; with two, GAE whitening sums float64 moments over the shards (float32 rounding apart)."""
    tolerance = "0" if workers == 1 else "1e-5"
    args = ["parity", "--steps", "3", "--tolerance", tolerance, "--out", str(tmp_path)]
    code = main([*args, *tiny_ppo_overrides(tiny_model_dir, *PPO_RUN, f"cluster.workers_per_node={workers}")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "parity OK" in out
    for name in (
        "train/reward",
        "train/loss",
        "train/grad_norm",
        "train/advantages/mean",
        "critic/loss",
        "critic/grad_norm",
        "critic/explained_var",
        "validation/accuracy",
    ):
        assert f"  {name} " in out, name


def test_ppo_parity_with_dynamic_sampling(tmp_path, tiny_model_dir, capsys):
    """PPO dynamic sampling (GRPO's filter) on both trainers: the same groups dropped, the same refills and surplus,
    so the same critic values, GAE, losses and dynamic-sampling counts, bit for bit (2 steps, no validation)."""
    ds = (
        "ppo.use_dynamic_sampling=true",
        "ppo.ppo_epochs=1",
        "ppo.val_period=0",
        "ppo.val_at_start=false",
        "ppo.val_at_end=false",
    )
    args = ["parity", "--steps", "2", "--tolerance", "0", "--out", str(tmp_path)]
    code = main([*args, *tiny_ppo_overrides(tiny_model_dir, *PPO_RUN, *ds)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "parity OK" in out and "  critic/loss " in out and "  train/filtered_reward " in out
    rows = [r for r in read_jsonl(tmp_path / "legacy" / "metrics.jsonl") if "train/reward" in r]
    batches = [r["train/dynamic_sampling_num_gen_batches"] for r in rows]
    surplus = [r["train/dynamic_sampling_num_discarded_valid_samples"] for r in rows]
    assert len(rows) == 2 and max(batches) > 1 and max(surplus) > 0, (batches, surplus)  # refilled; surplus discarded


def test_parity_async_at_age_zero_is_exact(tmp_path, tiny_model_dir, capsys):
    """`relayrl parity --async`: the data-plane trainer against async GRPO with max_trajectory_age_steps=0."""
    code = main(
        ["parity", "--async", "--steps", "3", "--out", str(tmp_path), *tiny_grpo_overrides(tiny_model_dir, *GRPO_RUN)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "parity OK" in out and "train/loss" in out and "validation/accuracy" in out
    assert (tmp_path / "async" / "metrics.jsonl").is_file()
    assert '"train/async/trajectory_age_mean": 0.0' in (tmp_path / "async" / "metrics.jsonl").read_text()

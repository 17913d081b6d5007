"""`data_parallel.strategy` without Ray: the config and the local executor refuse ddp/fsdp2 with several in-process
workers (one line naming the fix), and with one worker every strategy trains exactly like `manual`.

The multi-rank behaviour (DDP / FSDP2 against manual and one worker) is in
tests/integration/test_data_parallel_strategies.py (Ray, gloo).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from relayrl.algorithms.loss_functions import NLLLossFn
from relayrl.config import ClusterConfig, MasterConfig, PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.parallelize import DataParallel, decoder_layers
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.worker import load_causal_lm
from tests.helpers import small_policy_config


def policy_config(model_dir: Path, strategy: str) -> PolicyConfig:
    return small_policy_config(model_dir, data_parallel={"strategy": strategy})


def nll_batch(vocab: int) -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    return BatchedDataDict(
        input_ids=torch.randint(2, vocab, (4, 10), generator=g),  # [B, S]
        input_lengths=torch.tensor([10, 6, 8, 3]),
        token_mask=torch.ones(4, 10),
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_config_refuses_wrapping_on_several_local_workers(strategy: str) -> None:
    mbs = {"train_micro_batch_size": 64}  # 128 rows split into 2 workers of whole micro-batches
    overrides = {"policy": {"data_parallel": {"strategy": strategy}, **mbs}, "cluster": {"workers_per_node": 2}}
    with pytest.raises(ValidationError, match=r"policy.data_parallel.strategy=.* needs cluster.executor='ray'"):
        MasterConfig.model_validate(overrides)
    # one local worker, or Ray, is fine (fsdp2 optimizer checkpoints included: ranks gather their shards to save)
    MasterConfig.model_validate({**overrides, "cluster": {"workers_per_node": 1}})
    ray_cfg = {**overrides, "cluster": {"executor": "ray", "workers_per_node": 2}}
    assert MasterConfig.model_validate(ray_cfg).checkpointing.save_optimizer
    assert MasterConfig.model_validate(ray_cfg).policy.data_parallel.strategy == strategy
    # the critic's strategy is checked only when PPO builds a critic
    MasterConfig.model_validate({"policy": mbs, "value": overrides["policy"], "cluster": {"workers_per_node": 2}})
    with pytest.raises(ValidationError, match=r"value.data_parallel.strategy"):
        MasterConfig.model_validate(
            {"algorithm": "ppo", "policy": mbs, "value": overrides["policy"], "cluster": {"workers_per_node": 2}}
        )


def test_in_process_workers_refuse_wrapping_with_one_line(tiny_model_dir: Path, char_tokenizer) -> None:
    with pytest.raises(ValueError, match="needs a torch.distributed process group") as err:
        Policy(policy_config(tiny_model_dir, "ddp"), char_tokenizer, cluster=ClusterConfig(workers_per_node=2))
    assert "\n" not in str(err.value) and "cluster.executor='ray'" in str(err.value)
    with pytest.raises(ValueError, match="must be one of"):
        DataParallel(torch.nn.Linear(2, 2), "zero3", 1, torch.device("cpu"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_worker_runs_every_strategy_as_manual(tiny_model_dir: Path, char_tokenizer, strategy: str) -> None:
    vocab = len(char_tokenizer)
    results, weights = [], []
    for name in ("manual", strategy):
        policy = Policy(policy_config(tiny_model_dir, name), char_tokenizer, cluster=ClusterConfig())
        try:
            worker = policy.generation_source
            assert worker.dp.requested == name and worker.dp.strategy == "manual"
            assert worker.dp.train_module is worker.model  # no replica, no wrapper
            results.append(policy.train(nll_batch(vocab), NLLLossFn()))
            weights.append({k: v.clone() for k, v in policy.state_dict_for_refit().items()})
        finally:
            policy.shutdown()
    assert torch.equal(results[0]["loss"], results[1]["loss"])
    assert torch.equal(results[0]["grad_norm"], results[1]["grad_norm"])
    assert all(torch.equal(v, weights[1][k]) for k, v in weights[0].items())


def test_decoder_layers_are_the_fsdp2_units(tiny_model_dir: Path) -> None:
    model = load_causal_lm(policy_config(tiny_model_dir, "manual"))
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers == 2
    assert all(type(layer).__name__ == "Qwen2DecoderLayer" for layer in layers)
    assert decoder_layers(torch.nn.Linear(2, 2)) == []

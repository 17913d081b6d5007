"""Refit verification (`policy.generation.refit_verify`) catches each refit fault in the step it happens, in one line.

Every fault is injected into the real refit path of an in-process engine or of in-process generation workers (the
Ray workers' case is in tests/integration/test_ray_generation_refit.py, the asynchronous trainer's end to end in
tests/integration/test_refit_faults_e2e.py): a tensor the refit skips, a lossy cast on the way, a stale
compute-precision copy, LoRA adapters never merged into the engine's weights, stale FP8 KV scales, a snapshot the
producer's generation process never received.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig
from relayrl.distributed import refit
from relayrl.distributed.refit_digest import RefitVerificationError
from relayrl.models import fp8_kv
from relayrl.models.generation import process_generation
from relayrl.models.generation.digests import verify_snapshot_load
from relayrl.models.generation.distributed import DistributedGeneration
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.generation.worker import GenerationWorker
from relayrl.models.policy.lm_policy import Policy
from tests.helpers import small_policy_config
from tests.unit.models.generation.test_distributed_generation import train_once

NORM = "model.norm.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def ipc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))  # ZMQ IPC sockets private to this test
    return tmp_path


def workers(model_dir: Path, tokenizer: Any, **generation: Any) -> tuple[Policy, DistributedGeneration]:
    """A policy and one in-process colocated generation worker refitted over ZMQ IPC (the Ray path, in process)."""
    cfg = small_policy_config(model_dir, generation={"max_new_tokens": 4, **generation})
    policy = Policy(cfg, tokenizer, cluster=ClusterConfig(), init_reference_model=False)
    gen = DistributedGeneration(cfg.generation, tokenizer, policy, cluster=ClusterConfig(), policy_config=cfg)
    return policy, gen


def faulty_loader(fault: str) -> Any:
    """refit.load_into_module with a fault: skip the final norm's weight, or round every tensor through bfloat16."""
    real = refit.load_into_module

    def load_into_module(module: torch.nn.Module) -> Any:
        load = real(module)

        def faulty(batch: list[tuple[str, torch.Tensor]]) -> None:
            if fault == "skip":
                batch = [(n, t) for n, t in batch if n != NORM]
            else:
                batch = [(n, t.to(torch.bfloat16).to(t.dtype)) for n, t in batch]
            load(batch)

        return faulty

    return load_into_module


@pytest.mark.parametrize("fault", ["skip", "lossy_cast"])
def test_a_faulty_refit_fails_the_step_naming_the_tensor(fault, tiny_model_dir, char_tokenizer, ipc_dir, monkeypatch):
    policy, gen = workers(tiny_model_dir, char_tokenizer)
    try:
        gen.prepare_for_generation()  # a clean first refit passes
        train_once(policy, len(char_tokenizer))
        monkeypatch.setattr(refit, "load_into_module", faulty_loader(fault))
        with pytest.raises(RefitVerificationError) as err:
            gen.prepare_for_generation()
        line = str(err.value)
        tensor = NORM if fault == "skip" else "model.embed_tokens.weight"  # the first tensor of the state dict
        assert f"{tensor!r} on generation is not the trainer's" in line
        assert "after the IPC refit to weights_version 1" in line and "\n" not in line
    finally:
        gen.shutdown()
        policy.shutdown()


def test_log_mode_logs_the_line_and_generation_goes_on(tiny_model_dir, char_tokenizer, ipc_dir, monkeypatch, caplog):
    policy, gen = workers(tiny_model_dir, char_tokenizer, refit_verify="log")
    try:
        train_once(policy, len(char_tokenizer))
        monkeypatch.setattr(refit, "load_into_module", faulty_loader("skip"))
        with caplog.at_level(logging.WARNING):
            assert gen.prepare_for_generation()
        assert f"refit verification failed: {NORM!r}" in caplog.text
    finally:
        gen.shutdown()
        policy.shutdown()


def test_stale_fp8_scales_on_a_worker_are_caught(tiny_model_dir, char_tokenizer, ipc_dir):
    policy, gen = workers(tiny_model_dir, char_tokenizer, kv_cache_dtype="fp8")
    try:
        layers = fp8_kv.num_layers(policy.generation_source.model)
        scales = {fp8_kv.scale_name(layer, w): 0.25 for layer in range(layers) for w in ("k", "v")}
        gen.set_kv_scales(scales)
        gen.prepare_for_generation()  # the scales reach the worker with the first refit: verified equal
        v3 = fp8_kv.scale_name(layers - 1, "v")
        gen._group.run_all(GenerationWorker.set_kv_scales, {**scales, v3: 0.125})  # a worker with other scales
        with pytest.raises(RefitVerificationError, match=rf"'kv_scales/{v3}' on generation is not the trainer's"):
            gen.prepare_for_generation()
    finally:
        gen.shutdown()
        policy.shutdown()


def in_process(model_dir: Path, tokenizer: Any, **policy_keys: Any) -> tuple[Policy, HfGeneration]:
    """The local executor's engine as `setup` builds it: the policy's live weights, verified against the policy."""
    cfg = small_policy_config(model_dir, generation={"max_new_tokens": 4}, **policy_keys)
    policy = Policy(cfg, tokenizer, cluster=ClusterConfig(), init_reference_model=False)
    engine = HfGeneration(cfg.generation, tokenizer, policy.generation_source, precision=cfg.precision)
    engine.verify_against = policy.refit_digests
    engine.trainer_storage = policy.generation_storage  # what the engine reads in place is not compared
    return policy, engine


def test_in_place_reads_need_no_digests(tiny_model_dir, char_tokenizer):
    policy, engine = in_process(tiny_model_dir, char_tokenizer)
    try:
        assert engine.weight_digests() == {}  # float32, no LoRA: the engine reads the trainer's tensors themselves
    finally:
        policy.shutdown()
    policy, engine = in_process(tiny_model_dir, char_tokenizer, precision="bfloat16")
    try:
        keys = set(engine.weight_digests())
        assert keys and all(k.endswith("@bfloat16/compute") for k in keys)  # only its own copies
        assert f"{Q0}@bfloat16/compute" in keys
    finally:
        policy.shutdown()


def test_a_stale_compute_precision_copy_is_caught(tiny_model_dir, char_tokenizer):
    policy, engine = in_process(tiny_model_dir, char_tokenizer, precision="bfloat16")
    try:
        train_once(policy, len(char_tokenizer))
        engine.prepare_for_generation()  # the bf16 copies follow the trained weights
        weight = dict(policy.generation_source.model.named_parameters())[Q0]
        with torch.no_grad():
            weight.mul_(1.5)  # new weights written in place with no new version: the engine's copy is stale
        with pytest.raises(RefitVerificationError, match=rf"'{Q0}@bfloat16/compute' on the generation engine"):
            engine.prepare_for_generation()
    finally:
        policy.shutdown()


def test_lora_adapters_never_merged_into_the_engine_are_caught(tiny_model_dir, char_tokenizer):
    policy, engine = in_process(tiny_model_dir, char_tokenizer, lora={"enabled": True})
    try:
        engine.prepare_for_generation()
        train_once(policy, len(char_tokenizer))
        view = policy.generation_source
        view._version = policy.weights_version  # the merged view believes it is current: the new adapters are missing
        with pytest.raises(RefitVerificationError, match=r"q_proj.weight' on the generation engine is not the"):
            engine.prepare_for_generation()
        view._version = None  # merged again: verified
        engine.prepare_for_generation()
    finally:
        policy.shutdown()


def test_a_snapshot_the_generation_process_never_received_is_caught(tiny_model_dir, char_tokenizer, monkeypatch):
    policy, _ = in_process(tiny_model_dir, char_tokenizer)
    model = policy.generation_source.model
    cfg = small_policy_config(
        tiny_model_dir, generation={"max_new_tokens": 4, "colocated": {"enabled": False}}
    ).generation
    engine = process_generation.ProcessGeneration(
        cfg, char_tokenizer, model, 0, max_total_sequence_length=None, seed=0, num_threads=1, deterministic=True
    )
    try:
        train_once(policy, len(char_tokenizer))
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        engine.load_weights(snapshot, 1)
        verify_snapshot_load(engine.worker_digests(), snapshot, "enforce", "the producer's generation", 1)
        train_once(policy, len(char_tokenizer))
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        real_write = process_generation._Staging.write
        monkeypatch.setattr(  # the staging copy misses one tensor: the child loads last version's
            process_generation._Staging,
            "write",
            lambda self, s: real_write(self, {k: v for k, v in s.items() if k != Q0}),
        )
        engine.load_weights(snapshot, 2)
        with pytest.raises(RefitVerificationError, match=rf"'{Q0}' on the producer's generation is not the trainer's"):
            verify_snapshot_load(engine.worker_digests(), snapshot, "enforce", "the producer's generation", 2)
    finally:
        engine.shutdown()
        policy.shutdown()

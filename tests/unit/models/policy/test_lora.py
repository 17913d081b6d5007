"""LoRA on the policy (policy.lora): what trains, what the reference and generation see, what a checkpoint holds."""

from __future__ import annotations

import contextlib
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from relayrl.algorithms.loss_functions import ClippedPGLossFn, NLLLossFn
from relayrl.config import ClippedPGLossConfig, PolicyConfig
from relayrl.distributed import refit
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.fast.support import fast_path_unsupported
from relayrl.models.policy import lora
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.worker import PolicyWorker, load_causal_lm

B, S = 8, 12
LENGTHS = torch.tensor([12, 5, 7, 2, 12, 9, 3, 10])  # ragged, right-padded


def config(model_dir: Path, enabled: bool = True, **lora_cfg: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        dict(
            model_name=str(model_dir),
            train_global_batch_size=8,
            train_micro_batch_size=4,
            optimizer={"kwargs": {"lr": 1e-2}},
            lora={"enabled": enabled, **lora_cfg},
        )
    )


def batch(vocab: int) -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    real = torch.arange(S)[None, :] < LENGTHS[:, None]  # [B, S]
    ids = torch.randint(2, vocab, (B, S), generator=g).masked_fill(~real, 0)  # [B, S]
    token_mask = real.float()
    token_mask[:, :3] = 0.0  # a prompt
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=LENGTHS.clone(),
        token_mask=token_mask,
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, 1, generator=g).expand(B, S).clone(),
    )


def train_step(policy: Policy, data: BatchedDataDict) -> None:
    data = data.copy()
    data["prev_logprobs"] = data["generation_logprobs"] = policy.get_logprobs(data)["logprobs"]
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    policy.train(data, ClippedPGLossFn(ClippedPGLossConfig()))


def hf_logits(model: nn.Module, data: BatchedDataDict) -> torch.Tensor:
    mask = (torch.arange(S)[None, :] < data["input_lengths"][:, None]).long()  # [B, S]
    with torch.no_grad():
        return model(input_ids=data["input_ids"], attention_mask=mask).logits.float()  # [B, S, V]


@pytest.fixture
def policy(tiny_model_dir: Path, char_tokenizer) -> Any:
    p = Policy(config(tiny_model_dir), char_tokenizer)
    yield p
    p.shutdown()


def test_only_adapters_train_and_the_reference_is_the_base_model(policy, tiny_model_dir, char_tokenizer) -> None:
    worker = policy._group.worker(0)
    data = batch(len(char_tokenizer))
    trained = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    optimized = [p for group in worker.optimizer.param_groups for p in group["params"]]
    assert len(optimized) == len(trained)  # Adam state exists for the adapters alone
    assert worker.reference_model is None  # no second copy: the reference is the module with adapters off
    base = {n: t.clone() for n, t in worker.model.state_dict().items() if ".lora_" not in n}

    ref0 = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert torch.equal(policy.get_logprobs(data)["logprobs"], ref0)  # lora_B starts at 0: adds exactly nothing
    plain = Policy(config(tiny_model_dir, enabled=False), char_tokenizer, init_reference_model=False)
    try:  # the plain base model's own log-probs, bit for bit (both on the fast path)
        assert torch.equal(plain.get_logprobs(data)["logprobs"], ref0)
    finally:
        plain.shutdown()

    train_step(policy, data)
    assert all(torch.equal(base[n], t) for n, t in worker.model.state_dict().items() if ".lora_" not in n)
    assert torch.equal(policy.get_reference_policy_logprobs(data)["reference_logprobs"], ref0)
    moved = (policy.get_logprobs(data)["logprobs"] - ref0).abs().max()
    assert moved > 1e-3, f"the adapters did not change the policy ({moved})"


def test_generation_reads_merged_plain_weights(policy, tiny_model_dir, char_tokenizer) -> None:
    worker = policy._group.worker(0)
    data = batch(len(char_tokenizer))
    train_step(policy, data)
    source = policy.generation_source
    merged = source.model
    assert source.weights_version == worker.weights_version == 1
    assert not any(isinstance(m, LoraLayer) for m in merged.modules())
    assert fast_path_unsupported(merged, lm_head=True) is None  # generation keeps its fast decoder
    plain_names = list(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    assert list(policy.state_dict_for_refit()) == list(merged.state_dict()) == plain_names
    assert list(policy.prepare_refit_info()) == plain_names  # refit streams base-model names
    q = worker.model.model.layers[0].self_attn.q_proj
    expected = q.base_layer.weight + q.lora_B.default.weight @ q.lora_A.default.weight * q.scaling["default"]
    assert torch.equal(merged.model.layers[0].self_attn.q_proj.weight, expected.detach())
    # what merging never changes is shared with the live module, not copied
    assert merged.model.embed_tokens.weight is worker.model.model.embed_tokens.weight
    assert merged.model.layers[0].self_attn.q_proj.bias is q.base_layer.bias
    assert merged.model.norm.weight is worker.model.model.norm.weight
    # merged forward == adapter forward up to float32 rounding
    torch.testing.assert_close(hf_logits(merged, data), hf_logits(worker.model, data), rtol=0, atol=1e-4)
    train_step(policy, data)  # a new version: the view re-merges
    assert not torch.equal(source.model.model.layers[0].self_attn.q_proj.weight, expected.detach())


def test_checkpoint_holds_the_adapters_alone_and_round_trips(policy, tiny_model_dir, char_tokenizer, tmp_path) -> None:
    data = batch(len(char_tokenizer))
    train_step(policy, data)
    weights, optimizer = tmp_path / "weights", tmp_path / "optimizer"
    policy.save_checkpoint(str(weights), str(optimizer))
    assert sorted(p.name for p in weights.iterdir()) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]
    saved = load_file(str(weights / lora.ADAPTER_WEIGHTS))
    worker = policy._group.worker(0)
    adapter_tensors = {n: p for n, p in worker.model.named_parameters() if p.requires_grad}
    assert len(saved) == len(adapter_tensors) and all(".lora_A." in k or ".lora_B." in k for k in saved)
    total = sum(t.numel() for t in worker.model.state_dict().values())
    assert sum(t.numel() for t in saved.values()) < total / 4
    state = torch.load(optimizer / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    assert len(state) == len(adapter_tensors)
    assert json.loads((weights / lora.ADAPTER_CONFIG).read_text())["r"] == 8

    fresh = Policy(config(tiny_model_dir), char_tokenizer)
    try:
        fresh.load_checkpoint(str(weights), str(optimizer))
        assert fresh.weights_version == policy.weights_version
        assert torch.equal(fresh.get_logprobs(data)["logprobs"], policy.get_logprobs(data)["logprobs"])
        for name, tensor in fresh.state_dict_for_refit().items():
            assert torch.equal(tensor, policy.state_dict_for_refit()[name]), name
        with pytest.raises(ValueError, match="policy.lora.enabled=false"):
            full = tmp_path / "full"
            AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(full)
            fresh.load_checkpoint(str(full))
    finally:
        fresh.shutdown()
    other = Policy(config(tiny_model_dir, rank=4), char_tokenizer, init_reference_model=False)
    try:
        with pytest.raises(ValueError, match="policy.lora.rank"):
            other.load_checkpoint(str(weights))
    finally:
        other.shutdown()


def test_target_modules_choose_the_adapted_projections(tiny_model_dir, char_tokenizer) -> None:
    policy = Policy(config(tiny_model_dir, target_modules=["q_proj", "v_proj"], rank=2), char_tokenizer)
    try:
        worker = policy._group.worker(0)
        adapted = {n.rsplit(".", 1)[-1] for n, m in worker.model.named_modules() if isinstance(m, LoraLayer)}
        assert adapted == {"q_proj", "v_proj"}
        assert worker.model.model.layers[0].self_attn.q_proj.lora_A.default.weight.shape[0] == 2
    finally:
        policy.shutdown()
    with pytest.raises(ValueError, match="policy.lora.target_modules"):
        Policy(config(tiny_model_dir, target_modules=["no_such_proj"]), char_tokenizer)
    with pytest.raises(ValueError, match="only linear layers are supported"):
        Policy(config(tiny_model_dir, target_modules=["embed_tokens"]), char_tokenizer)


def test_config_refuses_what_cannot_work(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="fsdp2"):
        PolicyConfig.model_validate({"lora": {"enabled": True}, "data_parallel": {"strategy": "fsdp2"}})
    with pytest.raises(ValueError, match="target_modules is empty"):
        PolicyConfig.model_validate({"lora": {"enabled": True, "target_modules": []}})
    assert PolicyConfig().lora.enabled is False  # off by default
    assert lora.fast_path_note(config(tiny_model_dir)) is None  # no dropout: nothing leaves the fast path
    note = lora.fast_path_note(config(tiny_model_dir, dropout=0.1))
    assert note is not None and "\n" not in note and "training passes run through Hugging Face" in note


def test_refit_sends_the_merged_weights_over_both_transports(
    tiny_model_dir, char_tokenizer, monkeypatch, tmp_path
) -> None:
    """What separate generation workers receive (ZMQ IPC when colocated, the gloo broadcast otherwise) is the
    merged plain model, bit for bit what the in-process engine reads, loaded into a plain base-model copy."""
    monkeypatch.setenv(refit.IPC_DIR_ENV, str(tmp_path))
    cfg = config(tiny_model_dir)
    worker = PolicyWorker(cfg, char_tokenizer, init_reference_model=False)
    worker.train(batch(len(char_tokenizer)), NLLLossFn(), False, 8, 4)
    expected = worker.generation_view.model.state_dict()
    info = worker.prepare_refit_info()
    base = load_causal_lm(cfg).state_dict()
    assert any(not torch.equal(base[n], t) for n, t in expected.items())  # the adapters moved some weights

    with ThreadPoolExecutor(2) as pool:
        ipc_dst = load_causal_lm(cfg)  # the generation side: the base architecture, no adapters
        address = refit.ipc_address(refit.device_ipc_tag(worker.device, 0))
        got = pool.submit(refit.receive_weights_via_ipc_zmq, address, info, refit.load_into_module(ipc_dst))
        assert worker.stream_weights_via_ipc_zmq(1 << 16) and got.result(timeout=60)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        gloo_dst = load_causal_lm(cfg)

        def receive() -> None:
            group = refit.WeightUpdateGroup("127.0.0.1", port, 1, 2, timeout_s=60)
            group.receive_weights(info, refit.load_into_module(gloo_dst))

        received = pool.submit(receive)
        assert worker.init_collective("127.0.0.1", port, 2, train_world_size=1)
        assert worker.broadcast_weights_for_collective()
        received.result(timeout=60)
    for dst in (ipc_dst, gloo_dst):
        for name, tensor in dst.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
    worker.shutdown()


def test_the_fast_path_computes_lora_as_peft_does(policy, char_tokenizer) -> None:
    """The full-sequence passes keep the fast path under LoRA (adapters on or off); generation's decoder, which
    needs plain projections, reads the merged copy instead. Dropout active in training sends a pass to HF."""
    from relayrl.models.fast.forward import backbone_hidden_states

    worker = policy._group.worker(0)
    train_step(policy, batch(len(char_tokenizer)))  # non-zero lora_B
    model = worker.model
    assert fast_path_unsupported(model) is None
    assert "plain nn.Linear" in str(fast_path_unsupported(model, lm_head=True))
    g = torch.Generator().manual_seed(1)
    ids, lengths = torch.randint(2, len(char_tokenizer), (6, 20), generator=g), torch.tensor([20, 3, 11, 17, 1, 9])
    real = torch.arange(20)[None, :] < lengths[:, None]  # [6, 20]
    for mode in (contextlib.nullcontext(), lora.reference_mode(worker.peft_model)):
        with mode:
            fast = backbone_hidden_states(model, ids, lengths, fast=True)[real]  # [N, H]
            hf = backbone_hidden_states(model, ids, lengths, fast=False)[real]
        torch.testing.assert_close(fast, hf, rtol=0, atol=1e-5)
    q = model.model.layers[0].self_attn.q_proj
    q.lora_dropout["default"] = nn.Dropout(0.1)
    assert fast_path_unsupported(model.train()) is not None and fast_path_unsupported(model.eval()) is None

"""`relayrl export`: a run's checkpoint as a Hugging Face directory that transformers loads and generates with, whose
logits are the trained policy's (full fine-tuning and LoRA, merged or as adapters); bad input is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.cli.main import main
from relayrl.models.policy import lora
from relayrl.models.policy.lm_policy import Policy
from relayrl.utils.config_io import load_config
from relayrl.utils.paths import resolve_model_path
from tests.helpers import tiny_grpo_overrides

PROMPT = "<|user|>12+7=<|end|><|assistant|>"


def _train(run_dir: Path, *extra: str) -> Path:
    overrides = tiny_grpo_overrides(
        Path("unused"),
        "policy.model_name=builtin:tiny-arith",  # solves some problems: the weights move in two steps
        "policy.generation.max_new_tokens=12",
        "policy.optimizer.kwargs.lr=1e-2",
        "grpo.max_num_steps=2",
        "grpo.val_at_start=false",
        "checkpointing.save_period=1",
        "logger.tensorboard_enabled=false",
        *extra,
    )
    assert main(["train", "--run-dir", str(run_dir), *overrides]) == 0
    return run_dir / "checkpoints" / "step_2"


def _trained_policy(checkpoint: Path) -> tuple[Any, Any]:
    """The policy as training left it: its own config, its tokenizer, its checkpointed weights or adapters."""
    cfg = load_config(checkpoint / "config.yaml")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "policy" / "tokenizer")
    weights = checkpoint / "policy" / "weights"
    policy_cfg = cfg.policy if cfg.policy.lora.enabled else cfg.policy.model_copy(update={"model_name": str(weights)})
    policy = Policy(policy_cfg, tokenizer, init_reference_model=False, init_optimizer=False)
    if cfg.policy.lora.enabled:
        policy.load_checkpoint(str(weights))
    return policy, tokenizer


def _logits(model: Any, tokenizer: Any) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids  # [1, S]
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # [1, S, V]


def _loads_and_generates(out: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template is not None
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=6, do_sample=False)  # greedy: no sampling settings involved
    assert generated.shape[1] > ids.shape[1]
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 12
    return model, tokenizer


def test_export_of_a_full_run_loads_generates_and_has_the_policys_logits(tmp_path, capsys, monkeypatch) -> None:
    checkpoint = _train(tmp_path / "run")
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0  # newest complete: step 2
    assert str(checkpoint) in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()
    model, tokenizer = _loads_and_generates(out)
    policy, _ = _trained_policy(checkpoint)
    try:
        trained = _logits(policy._group.worker(0).model, tokenizer)
    finally:
        policy.shutdown()
    assert torch.equal(_logits(model, tokenizer), trained)

    step1 = tmp_path / "step1"
    assert main(["export", str(tmp_path / "run"), "--step", "1", "--out", str(step1)]) == 0
    assert not torch.equal(_logits(AutoModelForCausalLM.from_pretrained(step1), tokenizer), trained)

    capsys.readouterr()  # bad input: one line, exit 2, nothing written
    for argv, message in [
        (["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "run directory does not exist"),
        (["export", str(tmp_path / "run"), "--step", "7", "--out", str(tmp_path / "x")], "has no step_7"),
        (["export", str(tmp_path / "run"), "--out", str(out)], "exists and is not an empty directory"),
        (["export", str(tmp_path / "run"), "--adapters", "--out", str(tmp_path / "x")], "--adapters needs a LoRA"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "x").exists()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # as with HF_HUB_OFFLINE=1
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "x"), "--push-to-hub", "me/model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "offline" in err[0]
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("adapters", [False, True], ids=["merged", "adapters"])
def test_export_of_a_lora_run(tmp_path, adapters) -> None:
    checkpoint = _train(tmp_path / "run", "policy.lora.enabled=true", "policy.lora.rank=4")
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--out", str(out), *(["--adapters"] if adapters else [])]) == 0
    files = {p.name for p in out.iterdir()}
    if adapters:  # transformers loads an adapter directory through peft: base model + adapters
        assert {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS} <= files and "model.safetensors" not in files
    else:
        assert "model.safetensors" in files and lora.ADAPTER_CONFIG not in files
    model, tokenizer = _loads_and_generates(out)
    policy, _ = _trained_policy(checkpoint)
    try:
        worker = policy._group.worker(0)
        trained = _logits(worker.model, tokenizer)  # the LoRA module: base + B @ A x, adapters unmerged
        base_logits = _logits(
            AutoModelForCausalLM.from_pretrained(resolve_model_path(worker.cfg.model_name)), tokenizer
        )
    finally:
        policy.shutdown()
    assert (trained - base_logits).abs().max() > 1e-3  # the adapters learned something the export must carry
    torch.testing.assert_close(_logits(model, tokenizer), trained, rtol=0, atol=1e-5)

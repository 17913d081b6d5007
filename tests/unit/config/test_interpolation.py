"""`${...}` interpolations of NeMo RL's YAML files, resolved before validation."""

from __future__ import annotations

import pytest

from relayrl.config.interpolation import resolve_interpolations


def test_interpolations_resolve_like_the_reference_yaml() -> None:
    raw = {
        "policy": {
            "model_name": "m",
            "tokenizer": {"name": "${policy.model_name}"},
            "max_total_sequence_length": 512,
            "train_micro_batch_size": 4,
            "logprob_batch_size": "${policy.train_micro_batch_size}",
            "dynamic_batching": {"train_mb_tokens": "${mul:${policy.max_total_sequence_length}, 4}"},
            "generation": {"temperature": 0.5, "val_temperature": "${.temperature}", "note": "t=${.temperature}"},
        }
    }
    out = resolve_interpolations(raw)["policy"]
    assert out["tokenizer"]["name"] == "m" and out["logprob_batch_size"] == 4
    assert out["dynamic_batching"]["train_mb_tokens"] == 2048
    assert out["generation"]["val_temperature"] == 0.5 and out["generation"]["note"] == "t=0.5"
    with pytest.raises(ValueError, match="interpolation cycle"):
        resolve_interpolations({"a": "${b}", "b": "${a}"})
    with pytest.raises(ValueError, match=r"unsupported interpolation \$\{oc\.env:HOME\}"):
        resolve_interpolations({"a": "${oc.env:HOME}"})

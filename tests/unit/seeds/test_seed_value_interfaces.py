"""Seed page 002, `nemo_rl.models.value.interfaces` -> `relayrl.models.value.interfaces`: `ValueOutputSpec` and every
abstract `ValueInterface` method with its exact signature; the implementations keep them, and `get_values` returns
the page's shape ([batch_size, sequence_length] values)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.value.interfaces import ValueInterface, ValueOutputSpec
from relayrl.models.value.lm_value import Value, ValueConfig
from relayrl.models.value.tq_value import TQValue
from tests.unit.seeds.seed_signature import assert_seed_signature, assert_typeddict, seed_methods


# The page's signatures, written out (annotations dropped; `*` markers and defaults kept).
class SeedValueInterface:
    def get_values(self, data, timer=None): ...
    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None, timer=None): ...
    def prepare_for_training(self, *args, **kwargs): ...
    def prepare_for_inference(self, *args, **kwargs): ...
    def finish_training(self, *args, **kwargs): ...
    def save_checkpoint(self, *args, **kwargs): ...
    def shutdown(self): ...


def test_value_output_spec_is_the_pages_typeddict() -> None:
    assert_typeddict(ValueOutputSpec, ["values"])


@pytest.mark.parametrize("name", seed_methods(SeedValueInterface))
def test_value_interface_method(name: str) -> None:
    assert name in ValueInterface.__abstractmethods__
    assert_seed_signature(getattr(ValueInterface, name), getattr(SeedValueInterface, name), exact=True)


def test_value_interface_declares_nothing_beyond_the_page() -> None:
    assert ValueInterface.__abstractmethods__ == frozenset(seed_methods(SeedValueInterface))


@pytest.mark.parametrize("impl", [Value, TQValue])
@pytest.mark.parametrize("name", ["get_values", "train", "shutdown"])
def test_implementations_keep_the_signatures(impl: type, name: str) -> None:
    assert issubclass(impl, ValueInterface) and not impl.__abstractmethods__  # type: ignore[attr-defined]
    assert_seed_signature(getattr(impl, name), getattr(SeedValueInterface, name))


def test_get_values_returns_batch_by_sequence_values(tiny_model_dir: Path, char_tokenizer: Any) -> None:
    value = Value(ValueConfig(model_name=str(tiny_model_dir)), char_tokenizer, cluster=ClusterConfig(device="cpu"))
    try:
        lengths = torch.tensor([6, 3])
        ids = torch.randint(2, len(char_tokenizer), (2, 6), generator=torch.Generator().manual_seed(0))  # [B, S]
        out = value.get_values(BatchedDataDict(input_ids=ids, input_lengths=lengths), timer=None)
        assert set(out) == {"values"} and out["values"].shape == (2, 6)  # [B, S]
        assert out["values"][1, 3:].eq(0).all()  # padding positions hold 0
        assert value.shutdown() is True
    finally:
        value.shutdown()

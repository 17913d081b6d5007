"""Seed page 000, `nemo_rl.models.policy.interfaces` -> `relayrl.models.policy.interfaces`: every TypedDict and
abstract method the page names, with its exact signature; Policy and TQPolicy keep them."""

from __future__ import annotations

import pytest

from relayrl.models.policy.interfaces import (
    ColocatablePolicyInterface,
    LogprobOutputSpec,
    PolicyInterface,
    ReferenceLogprobOutputSpec,
    ScoreOutputSpec,
    TopkLogitsOutputSpec,
)
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.tq_policy import TQPolicy
from tests.unit.seeds.seed_signature import assert_seed_signature, assert_typeddict, seed_methods


# The page's signatures, written out (annotations dropped; the page's `*` markers and defaults kept).
class SeedPolicyInterface:
    def get_logprobs(self, data): ...
    def get_reference_policy_logprobs(self, data, micro_batch_size=None): ...
    def get_topk_logits(self, data, k, micro_batch_size=None): ...
    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None): ...
    def calibrate_qkv_fp8_scales(self, data, micro_batch_size=None, percentile=99.9, margin=1.05, include_q=False): ...
    def prepare_for_training(self, *args, **kwargs): ...
    def finish_training(self, *args, **kwargs): ...
    def save_checkpoint(self, *args, **kwargs): ...
    def shutdown(self): ...


class SeedColocatablePolicyInterface:
    def init_collective(self, ip, port, world_size, *, train_world_size): ...
    def offload_before_refit(self): ...
    def offload_after_refit(self): ...
    def prepare_refit_info(self): ...
    def stream_weights_via_ipc_zmq(self, *args, **kwargs): ...
    def broadcast_weights_for_collective(self, kv_scales=None): ...
    def prepare_for_lp_inference(self): ...


#: Seed methods whose page signature is not just (*args, **kwargs): implementations keep it (extras with defaults).
CONCRETE = [
    "get_logprobs",
    "get_reference_policy_logprobs",
    "get_topk_logits",
    "train",
    "calibrate_qkv_fp8_scales",
    "shutdown",
    "init_collective",
    "offload_before_refit",
    "offload_after_refit",
    "prepare_refit_info",
    "broadcast_weights_for_collective",
    "prepare_for_lp_inference",
]


def test_output_specs_are_the_pages_typeddicts() -> None:
    assert_typeddict(LogprobOutputSpec, ["logprobs"])
    assert_typeddict(ReferenceLogprobOutputSpec, ["reference_logprobs"])
    assert_typeddict(ScoreOutputSpec, ["scores"])
    assert_typeddict(TopkLogitsOutputSpec, ["topk_logits", "topk_indices"])


@pytest.mark.parametrize("name", seed_methods(SeedPolicyInterface))
def test_policy_interface_method(name: str) -> None:
    assert name in PolicyInterface.__abstractmethods__
    assert_seed_signature(getattr(PolicyInterface, name), getattr(SeedPolicyInterface, name), exact=True)


@pytest.mark.parametrize("name", seed_methods(SeedColocatablePolicyInterface))
def test_colocatable_policy_interface_method(name: str) -> None:
    assert issubclass(ColocatablePolicyInterface, PolicyInterface)
    assert name in ColocatablePolicyInterface.__abstractmethods__
    seed = getattr(SeedColocatablePolicyInterface, name)
    assert_seed_signature(getattr(ColocatablePolicyInterface, name), seed, exact=True)


def test_interfaces_declare_nothing_beyond_the_page() -> None:
    assert PolicyInterface.__abstractmethods__ == frozenset(seed_methods(SeedPolicyInterface))
    assert ColocatablePolicyInterface.__abstractmethods__ == frozenset(
        seed_methods(SeedPolicyInterface) + seed_methods(SeedColocatablePolicyInterface)
    )


@pytest.mark.parametrize("impl", [Policy, TQPolicy])
@pytest.mark.parametrize("name", CONCRETE)
def test_implementations_keep_the_signatures(impl: type, name: str) -> None:
    assert issubclass(impl, ColocatablePolicyInterface) and not impl.__abstractmethods__  # type: ignore[attr-defined]
    seed = getattr(SeedPolicyInterface, name, None) or getattr(SeedColocatablePolicyInterface, name)
    assert_seed_signature(getattr(impl, name), seed)

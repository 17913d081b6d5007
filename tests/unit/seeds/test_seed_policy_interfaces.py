"""Seed page 000, `nemo_rl.models.policy.interfaces` -> `relayrl.models.policy.interfaces`: every TypedDict and
abstract method the page names, with its exact signature, plus the refit methods' return shape (one handle per
worker, as the page's `list[ray.ObjectRef]`)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.config import ClusterConfig, PolicyConfig
from relayrl.distributed import refit
from relayrl.models.policy.interfaces import (
    ColocatablePolicyInterface,
    LogprobOutputSpec,
    PolicyInterface,
    ReferenceLogprobOutputSpec,
    ScoreOutputSpec,
    TopkLogitsOutputSpec,
)
from relayrl.models.policy.lm_policy import Policy, WorkerCall
from relayrl.models.policy.tq_policy import TQPolicy
from relayrl.models.policy.worker import load_causal_lm
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_refit_calls_return_one_handle_per_worker(tiny_model_dir: Path, char_tokenizer: Any) -> None:
    """Two in-process training ranks and this thread as the generation worker (reference rank 2 of 3): each refit
    call returns at once with one handle per training rank; `result()` is that rank's own result. The broadcast
    group is training rank 0 and the worker: rank 1 is no member and receives nothing."""
    cfg = PolicyConfig(model_name=str(tiny_model_dir))
    policy = Policy(cfg, char_tokenizer, cluster=ClusterConfig(workers_per_node=2, device="cpu"))
    try:
        info = policy.prepare_refit_info()
        assert info is not None
        port = _free_port()
        joined = policy.init_collective("127.0.0.1", port, 3, train_world_size=2)
        group = refit.WeightUpdateGroup("127.0.0.1", port, 1, 2, timeout_s=120)  # with training rank 0 only
        assert [type(h) for h in joined] == [WorkerCall, WorkerCall] and [h.rank for h in joined] == [0, 1]
        assert [h.result(timeout=120) for h in joined] == [True, True]
        assert [policy._group.worker(r)._weight_group.group is None for r in (0, 1)] == [False, True]

        receiver = load_causal_lm(cfg)
        with torch.no_grad():
            for tensor in receiver.parameters():
                tensor.zero_()  # stale weights: the broadcast must overwrite every one
        kv = {"model.layers.0.self_attn.k_scale": 0.5}
        sent = policy.broadcast_weights_for_collective(kv)
        assert len(sent) == 2
        assert group.receive_weights(info, refit.load_into_module(receiver)) == kv
        assert [h.result(timeout=120) for h in sent] == [True, True]
        live = policy.state_dict_for_refit()
        assert all(torch.equal(t, receiver.state_dict()[k]) for k, t in live.items())

        streamed = policy.stream_weights_via_ipc_zmq(1 << 20, kv_scales={"k_scale": 1.0})  # refused on each rank
        assert len(streamed) == 2
        with pytest.raises(ValueError, match="kv_scales must be None"):
            streamed[1].result(timeout=120)
    finally:
        policy.shutdown()

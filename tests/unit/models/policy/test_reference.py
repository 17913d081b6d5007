"""The policy's frozen reference (issue 27 item 3): built where it will live on the CPU, in host memory first on a
GPU (no full-precision copy on the device beside the policy), and refused in one line when it does not fit there."""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.models.policy import reference
from relayrl.models.tiny import build_tiny_qwen2


def _model() -> torch.nn.Module:
    return build_tiny_qwen2(64, hidden_size=32, num_layers=2, intermediate_size=64)  # tied head and embeddings


def test_a_host_copy_holds_the_same_weights_apart_with_ties_kept_and_frozen() -> None:
    model = _model().train()
    ref = reference.host_copy(model)
    live, copied = (
        dict(model.named_parameters(remove_duplicate=False)),
        dict(ref.named_parameters(remove_duplicate=False)),
    )
    assert list(copied) == list(live) and all(torch.equal(copied[k], v) for k, v in live.items())
    assert all(copied[k].data_ptr() != v.data_ptr() and not copied[k].requires_grad for k, v in live.items())
    assert ref.lm_head.weight is ref.model.embed_tokens.weight  # the tie survives the copy
    assert not ref.training and model.training  # the live model keeps its mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_cpu_the_reference_is_what_a_deep_copy_gives(dtype) -> None:
    model = _model()
    built = reference.build_reference(model, dtype, torch.device("cpu"), offload=False)
    expected = copy.deepcopy(model).eval().requires_grad_(False)
    reference.compact(expected, dtype)
    got, want = built.state_dict(), expected.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items())
    assert {t.dtype for n, t in got.items() if "proj" in n} == {dtype}  # projections in the compute precision
    assert got["model.embed_tokens.weight"].dtype == torch.float32  # the lookup reads float32 embeddings


def test_module_bytes_counts_a_shared_tensor_once() -> None:
    model = _model()
    params = {id(p): p for p in model.parameters()}.values()
    buffers = {id(b): b for b in model.buffers()}.values()
    expected = sum(t.numel() * t.element_size() for t in (*params, *buffers))
    assert reference.module_bytes(model) == expected
    assert expected < sum(p.numel() * 4 for _, p in model.named_parameters(remove_duplicate=False))  # tie counted once


def test_a_reference_that_does_not_fit_on_the_gpu_stops_set_up_in_one_line(monkeypatch) -> None:
    """Built in host memory, measured, refused before anything is moved: the driver's free-memory query is the one
    thing stood in for (this machine has no GPU; the gpu-marked runs take the fitting branch)."""
    model = _model()
    need = reference.module_bytes(reference.host_copy(model))  # float32: nothing compacted
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need, 80 * 2**30))  # no headroom left
    with pytest.raises(reference.ReferenceDoesNotFitError) as info:
        reference.build_reference(model, torch.float32, torch.device("cuda", 0), offload=False)
    gib = need / 2**30
    assert str(info.value) == (
        f"policy.reference: the reference model needs {gib:.2f} GiB on cuda:0 and {gib:.2f} GiB are free there "
        "beside the policy; set policy.reference.offload=true (host memory, moved over for each reference pass) or "
        "policy.precision=bfloat16 (a half-size reference)"
    )
    assert isinstance(info.value, ValueError)  # set-up's one line, exit 2
    assert reference.fits(need, int(need / (1 - reference.HEADROOM)) + 1) and not reference.fits(need, need)
    offloaded = reference.build_reference(model, torch.bfloat16, torch.device("cuda", 0), offload=True)
    assert {t.device.type for t in offloaded.state_dict().values()} == {"cpu"}  # offload never asks the device

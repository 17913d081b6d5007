"""A non-finite gradient never reaches the weights: the optimizer step is skipped (weights and Adam moments stay as
they were) and the norm reported, so the trainer can stop before the step is checkpointed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from relayrl.distributed.local import SingleProcessCollective
from relayrl.models.optim import all_reduce_clip_and_step
from relayrl.utils.state_file import NonFiniteStateError, assert_finite_state


def _model_and_adam() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # Adam moments exist
    return model, opt


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_skips_the_step(bad):
    model, opt = _model_and_adam()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    model.weight.grad[0, 0] = bad
    norm = all_reduce_clip_and_step(list(model.parameters()), SingleProcessCollective(), opt, max_grad_norm=1.0)
    assert not torch.isfinite(norm)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, opt.state.values()))


def test_a_finite_gradient_still_steps():
    model, opt = _model_and_adam()
    before = model.weight.detach().clone()
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    norm = all_reduce_clip_and_step(list(model.parameters()), SingleProcessCollective(), opt, max_grad_norm=1.0)
    assert torch.isfinite(norm) and not torch.equal(before, model.weight)


def test_non_finite_weights_are_never_checkpointed():
    model, _ = _model_and_adam()
    assert_finite_state(model.state_dict(), "policy weights")  # healthy weights pass
    with torch.no_grad():
        model.bias[1] = float("nan")
    with pytest.raises(NonFiniteStateError, match=r"policy weights: NaN or infinity in 1 of 2 tensors \(bias\)"):
        assert_finite_state(model.state_dict(), "policy weights")

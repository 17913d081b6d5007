"""What a generation engine reports to refit verification: digests of the tensors its next generate() reads.

Keys follow `relayrl.distributed.refit_digest`: the state-dict name of each module tensor (`name@dtype` when refits
deliver it in a narrower dtype than the module holds, e.g. bf16 values in a float32 generation worker, so the
trainer casts the same way), `name@dtype/compute` for the compute-precision copies of the projections, and
`kv_scales/<name>` for the FP8 KV-cache scales in use. The trainer side digests its own tensors under the same keys
(`PolicyWorker.refit_digests`), so the two meet as a few bytes per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from relayrl.distributed.refit_digest import (
    Digests,
    Mode,
    check,
    digest_all,
    dtype_name,
    expected_digests,
    scale_digests,
)


def module_digests(
    model: nn.Module,
    compute_copies: Mapping[int, torch.Tensor] | None,
    kv_scales: Mapping[str, float] | None,
    delivered: torch.dtype | None = None,
    trainer_storage: set[int] | None = None,
) -> Digests:
    """Digests of `model`'s state-dict tensors, of the compute copies (`ComputeWeights.copies()`: id(source) ->
    copy) and of the KV scales, computed where each tensor lives. Module tensors in `trainer_storage` (data
    pointers of the trainer's own tensors, in this process) are the trainer's very tensors: nothing to compare."""
    names = list(model.state_dict().keys())
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    items: list[tuple[str, torch.Tensor]] = []
    for name in names:
        t = tensors[name]
        if trainer_storage and t.data_ptr() in trainer_storage:
            continue
        if delivered is not None and t.is_floating_point() and t.dtype != delivered:
            items.append((f"{name}@{dtype_name(delivered)}", t.to(delivered)))
        else:
            items.append((name, t))
    for name in names if compute_copies else ():
        copy_ = compute_copies.get(id(tensors[name])) if compute_copies else None
        if copy_ is not None:
            items.append((f"{name}@{dtype_name(copy_.dtype)}/compute", copy_))
    out = digest_all(items)
    out.update(scale_digests(kv_scales))
    return out


def verify_engine(
    actual_fn: Callable[[], Digests], expected_fn: Callable[[list[str]], Digests], mode: Mode, version: int
) -> None:
    """An in-process engine against the trainer's weights (`expected_fn`: the policy's digests under given keys)."""
    if mode != "off":
        actual = actual_fn()
        if not actual:  # the engine reads the trainer's own tensors only
            return
        check(
            expected_fn(list(actual)), [actual], mode=mode, where="the generation engine", version=version, how="sync"
        )


def verify_snapshot_load(
    actuals: list[Digests], state: Mapping[str, torch.Tensor], mode: Mode, where: str, version: int
) -> None:
    """An engine that loaded a published weights snapshot (the asynchronous producer's refit) against that snapshot,
    digested where it lives (the trainer's side); `actuals`: one report per generation worker."""
    if mode != "off" and actuals:
        expected = expected_digests(state.items(), list(actuals[0]))
        check(expected, actuals, mode=mode, where=where, version=version, how="snapshot load")

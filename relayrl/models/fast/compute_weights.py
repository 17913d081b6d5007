"""Low-precision copies of a module's projection weights for decoding (`policy.precision` bfloat16 / float16).

Why: the trainer keeps float32 master weights (AdamW needs them), and its forward passes run the matrix products in
the compute precision under autocast. Decoding from the float32 module instead would spend twice the memory traffic
on every token; casting under autocast would re-cast the whole model on every generate() call and pay autocast's
dispatch on every op. The engine therefore keeps one copy of each projection's weight and bias (`nn.Linear`
modules, the LM head included) in the compute dtype, refreshed in place whenever the policy's weights move (a new
weights version or a refit). Embeddings and norm weights are not copied: a lookup and an RMSNorm read them in
float32, as autocast leaves them in the training forward, so generation and training round the same tensors.
"""

from __future__ import annotations

import torch
from torch import nn


class ComputeWeights:
    """dtype copies of every `nn.Linear` weight and bias of a module, looked up by the float32 tensor they copy."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype == torch.float32 or not dtype.is_floating_point:
            raise ValueError(f"ComputeWeights holds low-precision copies; got {dtype}")
        self.dtype = dtype
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(source) -> (source, copy)
        self.key: object = None  # what the copies were made from (the engine's weights key); None: never filled
        self.refreshes = 0

    def refresh(self, model: nn.Module, key: object) -> bool:
        """Copy the module's projection tensors unless they were copied under the same `key`; returns whether it
        copied. Copies are reused in place when a source tensor is the same object with the same shape."""
        if key == self.key and self._copies:
            return False
        fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for module in model.modules():
                if not isinstance(module, nn.Linear):
                    continue
                for source in (module.weight, module.bias):
                    if source is None or id(source) in fresh:  # tied weights: one copy
                        continue
                    old = self._copies.get(id(source))
                    if old is not None and old[0] is source and old[1].shape == source.shape:
                        copy = old[1].copy_(source)
                    else:
                        copy = source.detach().to(self.dtype, copy=True)
                    fresh[id(source)] = (source, copy)
        self._copies = fresh
        self.key = key
        self.refreshes += 1
        return True

    def __call__(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The copy of `tensor` (a projection weight or bias of the refreshed module); None stays None."""
        if tensor is None:
            return None
        entry = self._copies.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            raise KeyError("tensor is not a projection weight of the module ComputeWeights was refreshed from")
        return entry[1]

    def copies(self) -> dict[int, torch.Tensor]:
        """id(source tensor) -> its copy (tests compare them with the live weights)."""
        return {k: v[1] for k, v in self._copies.items()}

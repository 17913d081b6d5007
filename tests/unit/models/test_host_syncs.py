"""Host syncs on the hot path, counted on CPU (issue 27 item 3): every `.item()`, `.tolist()`, `.cpu()`, `.numpy()`
and `bool()`/`int()`/`float()` of a tensor is a device-to-host wait on a GPU, so the count here is what a CUDA run
pays. A decode step costs at most one (the check whether any row ended), and no count grows with the model's depth:
a 4-layer model pays exactly what a 2-layer one does, in generation and in training.

A training micro-batch costs at most 2: its loss metrics read in one copy, and the packed length the fast path's
forward needs (whether it has a sample to learn from is read once per global batch, from the rows as they arrived).

Host-to-device copies are counted the same way, by tracking which tensors a GPU run would hold on the device (the
model's parameters and buffers, whatever is made with `device=` or computed from a device tensor): a `.to(device)`
of a host tensor, a `copy_` from one into a device tensor, `torch.tensor(data, device=...)` and indexing a device
tensor with a host index are each a copy. A decode step copies nothing (a `generate` call copies its prompts once)
and a training micro-batch copies nothing (the global batch moves once, then micro-batches are cut on the device),
on the fast path and on Hugging Face's.
"""

from __future__ import annotations

import collections
import json
import sys
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.config import ClippedPGLossConfig, ClusterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.fast.forward import use_fast_path
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.tiny import build_tiny_qwen2, save_tiny_model
from tests.helpers import ragged_batch, small_policy_config

SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class HostSyncs(TorchFunctionMode):
    """Counts the tensor-to-host reads made while active, by the line of code that made them. `total` is what
    relayrl's (and the test's) code reads; `in_transformers` what Hugging Face's own forward reads (its mask
    builder checks whether a padding mask can be skipped: on the HF fallback only, never on the fast path)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_line: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNCS:
            self.by_line[f"{_caller()} {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(n for line, n in self.by_line.items() if not line.startswith("transformers/"))

    @property
    def in_transformers(self) -> int:
        return sum(n for line, n in self.by_line.items() if line.startswith("transformers/"))


def _caller() -> str:
    """The first frame outside torch and outside these counters, as `file:line` (`transformers/` before the name
    of a file of Hugging Face's)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (
        "/torch/" in frame.f_code.co_filename or frame.f_code.co_name == "__torch_function__"
    ):
        frame = frame.f_back
    where = "transformers/" if "/transformers/" in frame.f_code.co_filename else ""
    return f"{where}{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class HostToDevice(TorchFunctionMode):
    """Counts the host-to-device copies a GPU run would make, on CPU: tensors are followed from `resident` (what
    lives on the device: the model's parameters and buffers) through every op; a copy is a move of a host tensor to
    a device, a `copy_` of one into a device tensor, a tensor made from host data with `device=`, or a device tensor
    indexed with a host one. Counting starts when `counting` is set (a warm-up call inside the mode makes the
    engine's caches device tensors, as they are on a GPU)."""

    MOVES = {torch.Tensor.to, torch.Tensor.cuda}
    FROM_DATA = {torch.tensor, torch.as_tensor}
    INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}

    def __init__(self, resident: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.device_tensors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        for t in resident:
            self.device_tensors[id(t)] = t
        self.by_line: collections.Counter[str] = collections.Counter()
        self.counting = False

    def on_device(self, t: torch.Tensor) -> bool:
        return self.device_tensors.get(id(t)) is t

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        from_device = any(self.on_device(t) for t in inputs)
        copies = False
        if func in self.MOVES:
            targeted = (
                func is torch.Tensor.cuda
                or "device" in kwargs
                or any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:])
            )
            copies = targeted and not self.on_device(args[0])
            if copies and out is args[0]:
                out = out.clone()  # a transfer makes a new tensor; CPU's `.to("cpu")` hands back the host one
            resident = from_device or targeted
        elif func is torch.Tensor.copy_:
            resident = self.on_device(args[0])
            copies = resident and not self.on_device(args[1])
        elif func in self.FROM_DATA:
            resident = kwargs.get("device") is not None
            copies = resident and not (inputs and all(self.on_device(t) for t in inputs))
        elif func in self.INDEXING:
            resident = from_device
            copies = self.on_device(args[0]) and any(not self.on_device(t) for t in _tensors(args[1]))
        else:
            resident = from_device or kwargs.get("device") is not None
        if resident:
            for t in _tensors(out):
                self.device_tensors[id(t)] = t
        if copies and self.counting:
            self.by_line[f"{_caller()} {func.__name__}"] += 1
        return out

    total = HostSyncs.total
    in_transformers = HostSyncs.in_transformers


def _device_state(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


class _Source:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights_version = 0


def _prompts(tokenizer: Any) -> BatchedDataDict:
    encoded = [tokenizer(p)["input_ids"] for p in ("12+34=", "7-3=", "99-1=", "5+5=")]
    ids = torch.full((len(encoded), max(map(len, encoded))), tokenizer.pad_token_id, dtype=torch.long)  # [B, S]
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in encoded]))


def _decode(tokenizer: Any, layers: int, max_new_tokens: int, fast_path: bool) -> tuple[int, int, int, int]:
    """(host syncs, host-to-device copies, decode steps, host syncs inside transformers) of one sampled generate()
    call, as a GPU would run it (no compiled CPU kernels) on the fast path or Hugging Face's."""
    from relayrl.config import GenerationConfig

    model = build_tiny_qwen2(len(tokenizer), num_layers=layers)
    engine = HfGeneration(
        # no stop token: every step runs
        GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=[], native_cpu_decode=False),
        tokenizer,
        _Source(model),
        fast_path=fast_path,
    )
    with HostToDevice(_device_state(model)) as copies:
        engine.generate(_prompts(tokenizer), greedy=False)  # warm: first-call set-up is not the steady state
        copies.counting = True
        with HostSyncs() as syncs:
            out = engine.generate(_prompts(tokenizer), greedy=False)
    return syncs.total, copies.total, int(out["generation_lengths"].max()), syncs.in_transformers


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "hf"])
def test_a_decode_step_costs_at_most_one_host_sync_no_copy_and_depth_nothing(char_tokenizer, fast_path) -> None:
    short_syncs, short_copies, steps_short, short_hf = _decode(char_tokenizer, 2, 4, fast_path)
    long = long_syncs, long_copies, steps_long, long_hf = _decode(char_tokenizer, 2, 12, fast_path)
    assert (steps_short, steps_long) == (4, 12)
    assert long_syncs - short_syncs <= steps_long - steps_short  # at most one more per extra decode step
    assert long_copies == short_copies <= 3  # the prompts, their lengths, the token limits: once per call
    # HF's mask builder reads its padding mask once per forward; the fast path never enters it
    assert long_hf - short_hf == (0 if fast_path else steps_long - steps_short)
    assert _decode(char_tokenizer, 4, 12, fast_path) == long  # none per layer


def _train_counts(tokenizer: Any, root: Path, layers: int, micro_batch: int, fast_path: bool) -> tuple[int, int, int]:
    """(host syncs, host-to-device copies, host syncs inside transformers) of one train() call on 8 rows (one global batch) in micro-batches of
    `micro_batch`; a GELU model takes Hugging Face's forward (the fast path is SiLU only)."""
    if not (root / "config.json").is_file():
        save_tiny_model(root, build_tiny_qwen2(len(tokenizer), num_layers=layers), tokenizer)
        if not fast_path:
            config = json.loads((root / "config.json").read_text())
            (root / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    cfg = small_policy_config(root, train_global_batch_size=8, train_micro_batch_size=micro_batch)
    policy = Policy(cfg, tokenizer, cluster=ClusterConfig(device="cpu"), init_reference_model=False)
    try:
        model = policy.worker_group.worker(0).model
        assert use_fast_path(model, None) is fast_path

        def batch() -> BatchedDataDict:
            data = ragged_batch(len(tokenizer), 0, torch.tensor([9, 5, 7, 3, 8, 6, 4, 9]), torch.ones(8), seq_len=9)
            data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
            data["generation_logprobs"] = data["prev_logprobs"].clone()
            data["reference_policy_logprobs"] = data["prev_logprobs"].clone()
            return data

        loss = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
        warm, measured = batch(), batch()
        with HostToDevice(_device_state(model)) as copies:
            policy.train(warm, loss)
            copies.counting = True
            with HostSyncs() as syncs:
                policy.train(measured, loss)
        return syncs.total, copies.total, syncs.in_transformers
    finally:
        policy.shutdown()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "hf"])
def test_a_training_micro_batch_costs_at_most_two_host_syncs_no_copy_and_depth_nothing(
    char_tokenizer, tmp_path, fast_path
) -> None:
    four_mb = _train_counts(char_tokenizer, tmp_path / "l2", 2, 2, fast_path)
    eight_mb = _train_counts(char_tokenizer, tmp_path / "l2", 2, 1, fast_path)
    assert eight_mb[0] - four_mb[0] <= 2 * 4, f"{four_mb[0]} host syncs for 4 micro-batches, {eight_mb[0]} for 8"
    # the global batch moves to the device once, one copy per field (8) and one row index for them all
    assert eight_mb[1] == four_mb[1] <= 9, f"{four_mb[1]} copies for 4 micro-batches, {eight_mb[1]} for 8"
    assert eight_mb[2] - four_mb[2] <= (0 if fast_path else 2 * 4)  # HF's mask builder: at most 2 per forward
    assert _train_counts(char_tokenizer, tmp_path / "l4", 4, 2, fast_path) == four_mb  # none per layer


if __name__ == "__main__":  # pragma: no cover - prints the counts by line
    pytest.main([__file__, "-q"])

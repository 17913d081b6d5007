"""Host syncs on the hot path, counted on CPU (issue 27 item 3): every `.item()`, `.tolist()`, `.cpu()`, `.numpy()`
and `bool()`/`int()`/`float()` of a tensor is a device-to-host wait on a GPU, so the count here is what a CUDA run
pays. A decode step costs at most one (the check whether any row ended), and no count grows with the model's depth:
a 4-layer model pays exactly what a 2-layer one does, in generation and in training.

A training micro-batch costs at most 2: its loss metrics read in one copy, and the packed length the fast path's
forward needs (whether it has a sample to learn from is read once per global batch, from the rows as they arrived).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.config import ClippedPGLossConfig, ClusterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
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
    """Counts the tensor-to-host reads made while active, by the line of relayrl (or test) code that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.by_line: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNCS:
            frame = sys._getframe(1)
            while frame.f_back is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            self.by_line[f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_line.values())


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


def _decode(tokenizer: Any, layers: int, max_new_tokens: int) -> tuple[int, int]:
    """(host syncs, decode steps) of one sampled generate() call."""
    from relayrl.config import GenerationConfig

    engine = HfGeneration(
        GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=[]),  # no stop token: every step runs
        tokenizer,
        _Source(build_tiny_qwen2(len(tokenizer), num_layers=layers)),
    )
    batch = _prompts(tokenizer)
    engine.generate(batch, greedy=False)  # warm: first-call set-up is not the steady state
    with HostSyncs() as syncs:
        out = engine.generate(batch, greedy=False)
    return syncs.total, int(out["generation_lengths"].max())


def test_a_decode_step_costs_at_most_one_host_sync_and_depth_costs_none(char_tokenizer) -> None:
    short, steps_short = _decode(char_tokenizer, layers=2, max_new_tokens=4)
    long, steps_long = _decode(char_tokenizer, layers=2, max_new_tokens=12)
    assert (steps_short, steps_long) == (4, 12)
    assert long - short <= steps_long - steps_short  # at most one more per extra decode step
    assert _decode(char_tokenizer, layers=4, max_new_tokens=12) == (long, steps_long)  # none per layer


def _train_syncs(tokenizer: Any, root: Path, layers: int, micro_batch: int = 2) -> int:
    """Host syncs of one train() call on 8 rows (one global batch) in micro-batches of `micro_batch`."""
    if not (root / "config.json").is_file():
        save_tiny_model(root, build_tiny_qwen2(len(tokenizer), num_layers=layers), tokenizer)
    cfg = small_policy_config(root, train_global_batch_size=8, train_micro_batch_size=micro_batch)
    policy = Policy(cfg, tokenizer, cluster=ClusterConfig(device="cpu"), init_reference_model=False)
    try:
        data = ragged_batch(len(tokenizer), 0, torch.tensor([9, 5, 7, 3, 8, 6, 4, 9]), torch.ones(8), seq_len=9)
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
        data["generation_logprobs"] = data["prev_logprobs"].clone()
        data["reference_policy_logprobs"] = data["prev_logprobs"].clone()
        loss = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
        policy.train(data, loss)  # warm
        with HostSyncs() as syncs:
            policy.train(data, loss)
        return syncs.total
    finally:
        policy.shutdown()


def test_a_training_micro_batch_costs_at_most_two_host_syncs_and_depth_none(char_tokenizer, tmp_path) -> None:
    four_mb = _train_syncs(char_tokenizer, tmp_path / "l2", 2)
    eight_mb = _train_syncs(char_tokenizer, tmp_path / "l2", 2, micro_batch=1)
    assert eight_mb - four_mb <= 2 * 4, f"{four_mb} host syncs for 4 micro-batches, {eight_mb} for 8"
    assert _train_syncs(char_tokenizer, tmp_path / "l4", 4) == four_mb  # none per layer


if __name__ == "__main__":  # pragma: no cover - prints the counts by line
    pytest.main([__file__, "-q"])

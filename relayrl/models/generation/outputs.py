"""The engines' output layout: per-row token budgets and the right-padded `GenerationOutputSpec` every engine returns
(the in-process engine, its child-process host and the distributed façade stitching workers' shards)."""

from __future__ import annotations

import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.generation.interfaces import GenerationOutputSpec

__all__ = ["assemble_output", "empty_generation", "generation_limits"]


def generation_limits(lengths: torch.Tensor, max_new_tokens: int, max_total: int | None) -> torch.Tensor:
    """Token budget per row [B]: max_new_tokens, capped by what the context limit leaves after the prompt."""
    limits = torch.full((lengths.shape[0],), max_new_tokens, dtype=torch.long)  # [B]
    if max_total is not None:
        limits = torch.minimum(limits, max_total - lengths.long().cpu())
        if lengths.shape[0] and int(limits.min()) < 1:
            row = int(limits.argmin())
            raise ValueError(
                f"row {row}: prompt of {int(lengths[row])} tokens leaves no room for generation under "
                f"max_total_sequence_length={max_total}"
            )
    return limits


def empty_generation(max_new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`assemble_output`'s generated parts for a batch of no rows: tokens, logprobs [0, N], lengths, stopped [0]."""
    return (
        torch.zeros((0, max_new), dtype=torch.long),
        torch.zeros((0, max_new)),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.bool),
    )


def assemble_output(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    gen_len: torch.Tensor,
    stopped: torch.Tensor,
    pad_id: int,
) -> BatchedDataDict[GenerationOutputSpec]:
    """Right-padded outputs: prompt, the generated tokens right after it, then pad (logprobs 0 off generation)."""
    batch, width = input_ids.shape
    max_new = tokens.shape[1]
    steps = torch.arange(max_new)
    generated = steps.unsqueeze(0) < gen_len.unsqueeze(1)  # [B, N]
    in_prompt = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # [B, S]
    cols = lengths.unsqueeze(1) + steps.unsqueeze(0)  # [B, N] output column of each generated token
    output_ids = torch.full((batch, width + max_new), pad_id, dtype=torch.long)
    output_ids[:, :width] = torch.where(in_prompt, input_ids, pad_id)
    output_ids.scatter_(1, cols, torch.where(generated, tokens, pad_id))
    output_logprobs = torch.zeros((batch, width + max_new), dtype=torch.float32)
    output_logprobs.scatter_(1, cols, torch.where(generated, logprobs.float(), 0.0))
    return BatchedDataDict(
        output_ids=output_ids,
        logprobs=output_logprobs,
        generation_lengths=gen_len.clone(),
        unpadded_sequence_lengths=lengths + gen_len,
        truncated=~stopped,
    )

"""Per-sequence train/generation log-prob agreement, and optional masking of sequences that disagree too much.

When the training forward and the generation engine compute different probabilities for the sampled tokens (kernel,
precision or weight-sync bugs), the update is silently off-policy. The per-sequence mean of exp(|gen - prev|) is 1
for perfect agreement; sequences above a threshold can be dropped from the loss by zeroing their sample mask.
"""

from __future__ import annotations

import torch


def _stats(errors: torch.Tensor, prefix: str, suffix: str = "") -> dict[str, float]:
    """max / mean / min of a 1-D tensor (all 0 when empty)."""
    if errors.numel() == 0:
        return {f"max_{prefix}{suffix}": 0.0, f"mean_{prefix}{suffix}": 0.0, f"min_{prefix}{suffix}": 0.0}
    return {
        f"max_{prefix}{suffix}": float(errors.max()),
        f"mean_{prefix}{suffix}": float(errors.mean()),
        f"min_{prefix}{suffix}": float(errors.min()),
    }


def per_sequence_logprob_error(
    token_mask: torch.Tensor,  # [B, S]
    sample_mask: torch.Tensor,  # [B]
    prev_logprobs: torch.Tensor,  # [B, S] token-aligned
    generation_logprobs: torch.Tensor,  # [B, S] token-aligned
) -> tuple[torch.Tensor, torch.Tensor]:
    """(err [B], loss tokens [B]): err_i = sum_t exp(|g - p| * m) * m / sum_t m over m = token_mask[:, 1:] * sample_mask.

    Row-local on purpose: data-parallel workers reduce their own rows and the driver gets 8 bytes a row, with values
    identical to a driver-side computation.
    """
    m = token_mask[:, 1:].float() * sample_mask.float().unsqueeze(-1)  # [B, S-1]
    abs_err = (generation_logprobs[:, 1:].float() - prev_logprobs[:, 1:].float()).abs()  # [B, S-1]
    num_tokens = m.sum(dim=-1)  # [B]
    # where() rather than a product: a non-finite value at a masked position must not poison the row (inf * 0).
    per_token = torch.where(m > 0, torch.exp(abs_err) * m, torch.zeros_like(m))  # [B, S-1]
    return per_token.sum(dim=-1) / num_tokens.clamp(min=1), num_tokens  # [B], [B]


def seq_logprob_error_metrics_from_rows(
    seq_err: torch.Tensor,  # [B]
    num_tokens: torch.Tensor,  # [B]
    sample_mask: torch.Tensor,  # [B]
    rewards: torch.Tensor | None,  # [B]
    seq_logprob_error_threshold: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The statistics and optional masking of `compute_seq_logprob_error_metrics`, from per-row errors."""
    has_tokens = num_tokens > 0  # [B]
    metrics = _stats(seq_err[has_tokens], "seq_mult_prob_error")
    if seq_logprob_error_threshold is None:
        return sample_mask, metrics

    old_mask = sample_mask.float()  # [B]
    keep = (seq_err <= seq_logprob_error_threshold).float() * old_mask  # [B]
    newly_masked = (old_mask - keep) > 0  # [B]
    num_masked = int(newly_masked.sum())
    metrics["num_masked_seqs_by_logprob_error"] = float(num_masked)
    if num_masked > 0 and rewards is not None:
        metrics["masked_correct_pct"] = float((rewards[newly_masked].float() == 1).float().mean())
    else:
        metrics["masked_correct_pct"] = 0.0
    metrics.update(_stats(seq_err[has_tokens & (keep > 0)], "seq_mult_prob_error", "_after_mask"))

    out_dtype = sample_mask.dtype if sample_mask.is_floating_point() else torch.float32
    return keep.to(out_dtype), metrics


def compute_seq_logprob_error_metrics(
    token_mask: torch.Tensor,  # [B, S]
    sample_mask: torch.Tensor,  # [B]
    prev_logprobs: torch.Tensor,  # [B, S] token-aligned
    generation_logprobs: torch.Tensor,  # [B, S] token-aligned
    rewards: torch.Tensor | None,  # [B]
    seq_logprob_error_threshold: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (sample mask, metrics).

    err_i = sum_t exp(|g - p| * m) * m / sum_t m over the loss positions m = token_mask[:, 1:] * sample_mask; rows
    without valid tokens are left out of the statistics. Without a threshold the sample mask is returned unchanged
    (same object). With threshold tau, rows with err_i > tau get sample_mask 0 (rows without valid tokens count as
    err 0 and are kept), and `masked_correct_pct` is the fraction of newly masked rows whose reward is exactly 1.
    """
    seq_err, num_tokens = per_sequence_logprob_error(token_mask, sample_mask, prev_logprobs, generation_logprobs)
    return seq_logprob_error_metrics_from_rows(seq_err, num_tokens, sample_mask, rewards, seq_logprob_error_threshold)

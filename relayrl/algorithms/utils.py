"""Small pure tensor helpers shared by losses, advantage estimators and the GRPO driver.

Everything here is torch-only and side-effect free, so it runs unchanged on CPU or GPU and can be unit-tested
against hand-computed numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

KL_TYPES = ("k1", "k2", "k3")

#: Driver-side metrics that are averaged (not summed) over micro-batches: they are attached identically to every
#: micro-batch (lr, counts) or are per-step means already.
AVERAGED_TRAIN_METRICS = frozenset(
    {"lr", "wd", "reward", "filtered_reward", "global_valid_seqs", "global_valid_toks", "mean_prompt_length"}
)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    global_normalization_factor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """sum(values * mask) / (D + 1e-8), D = the given global count or sum(mask).

    Passing the *global* count makes the result a partial sum of the global-batch mean, so micro-batch results
    add up exactly. An all-zero mask gives 0 (never NaN) thanks to the epsilon.
    """
    masked = values * mask
    numerator = masked.sum() if dim is None else masked.sum(dim=dim)
    if global_normalization_factor is not None:
        denominator = global_normalization_factor
    else:
        denominator = mask.sum() if dim is None else mask.sum(dim=dim)
    return numerator / (denominator + 1e-8)


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Variance over the masked entries; the Bessel factor n/(n-1) is skipped when n <= 1 (it would be inf)."""
    if mean is None:
        mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def calculate_kl(
    logprobs: torch.Tensor,
    logprobs_reference: torch.Tensor,
    kl_type: str = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
    importance_sampling_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate (Schulman's k1/k2/k3) from sampled-token log-probs.

    The log-ratio is clamped first (exp() of a huge ratio would blow up k3); where that clamp bites, the importance
    weight is detached so no gradient sneaks through a value the estimator never saw. The output clamp is applied
    after weighting, so clamped positions carry zero gradient.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"Invalid KL type: {kl_type!r}; expected one of {KL_TYPES}")
    log_ratio = logprobs_reference - logprobs  # log(pi_ref / pi)
    weights = importance_sampling_weights
    if input_clamp_value is not None:
        clamped = log_ratio.clamp(min=-input_clamp_value, max=input_clamp_value)
        if weights is not None:
            weights = torch.where(clamped != log_ratio, weights.detach(), weights)
        log_ratio = clamped

    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    else:
        kl = log_ratio.exp() - 1 - log_ratio

    if weights is not None:
        kl = kl * weights
    if output_clamp_value is not None:
        kl = kl.clamp(min=-output_clamp_value, max=output_clamp_value)
    return kl


def calculate_baseline_and_std_per_prompt(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out_baseline: bool = True,
    std_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row baseline and std of the rewards of its group (rows with identical prompt tokens).

    Leave-one-out uses the *other* valid rows of the group. Groups with at most one valid row get baseline = reward
    (zero advantage) and std 0. Under LOO an invalid row still sums all other valid rewards but divides by
    #valid - 1 (the reference's quirk, kept). Statistics are accumulated in float64 so very large or tiny rewards stay
    finite; results come back in the rewards' dtype and device.
    """
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        empty = torch.zeros(rewards.shape, dtype=out_dtype, device=rewards.device)
        return empty, empty.clone()
    if std_rewards is None:
        std_rewards = rewards

    r = rewards.to(torch.float64)  # [B]
    s = std_rewards.to(device=rewards.device, dtype=torch.float64)  # [B]
    v = valid_mask.to(device=rewards.device, dtype=torch.float64)  # [B]
    _, group_ids = torch.unique(prompts, dim=0, return_inverse=True)  # [B]
    group_ids = group_ids.to(rewards.device)
    num_groups = int(group_ids.max()) + 1

    def group_total(x: torch.Tensor) -> torch.Tensor:
        """Sum of x over each row's group, per row: [B] -> [B] (one scatter, no loop over groups)."""
        return torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, group_ids, x)[group_ids]

    def others(x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the row's group (leave-one-out: over the group's *other* rows)."""
        total = group_total(x)
        return total - x if leave_one_out_baseline else total

    num_valid = group_total(v)  # [B] valid rows in the row's group
    k = num_valid - 1 if leave_one_out_baseline else num_valid  # [B] divisor
    scored = num_valid > 1  # groups with at most one valid row: baseline = reward, std 0
    safe_k = torch.where(scored, k, torch.ones_like(k))
    baseline = torch.where(scored, others(r * v) / safe_k, r).to(out_dtype)
    has_std = scored & (k > 1)
    m1 = others(s * v) / safe_k  # [B]
    m2 = others(s.square() * v) / safe_k  # [B]
    # Rounding (or the invalid-row LOO quirk) can make m2 - m1^2 slightly negative: that reads as std 0.
    var = ((m2 - m1.square()) * (safe_k / torch.where(has_std, safe_k - 1, torch.ones_like(k)))).clamp(min=0)
    std = torch.where(has_std, torch.nan_to_num(var.sqrt(), nan=0.0), torch.zeros_like(var)).to(out_dtype)
    return baseline, std


def _to_floats(values: Any) -> list[float]:
    """Flatten a list of scalars / tensors / arrays into python floats."""
    if isinstance(values, torch.Tensor):
        return [float(x) for x in values.detach().flatten().tolist()]
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy arrays and scalars
        values = values.tolist()
        if not isinstance(values, list):
            return [float(values)]
    out: list[float] = []
    for item in values if isinstance(values, Iterable) else [values]:
        if isinstance(item, (list, tuple)) or (isinstance(item, torch.Tensor) and item.numel() != 1):
            out.extend(_to_floats(item))
        else:
            out.append(float(item))
    return out


def aggregate_train_metrics(all_mb_metrics: dict[str, Any]) -> dict[str, float]:
    """Reduce per-micro-batch metric lists to one number each (driver side).

    Loss metrics are already divided by the global counts, so their micro-batch values are *summed*; extrema
    (`*_min` / `*_max`) take min / max over finite entries (-1 when none); values attached identically to every
    micro-batch (`lr`, global counts, ...) are averaged. A plain scalar passes through.
    """
    out: dict[str, float] = {}
    for key, raw in all_mb_metrics.items():
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            out[key] = float(raw)
            continue
        values = _to_floats(raw)
        if key.endswith("_min") or key.endswith("_max"):
            finite = [x for x in values if math.isfinite(x)]
            out[key] = (min(finite) if key.endswith("_min") else max(finite)) if finite else -1.0
        elif key in AVERAGED_TRAIN_METRICS:
            out[key] = sum(values) / len(values) if values else 0.0
        else:
            out[key] = float(sum(values))
    return out


def policy_train_metrics(result: dict[str, Any]) -> dict[str, float]:
    """One `policy.train` result as flat metrics: micro-batch metrics aggregated, loss summed, grad norm."""
    out = aggregate_train_metrics(result["all_mb_metrics"])
    out["loss"] = float(result["loss"].sum())
    if result.get("grad_norm") is not None:
        out["grad_norm"] = float(result["grad_norm"])
    return out


def mean_over_epochs(per_epoch: list[dict[str, float]]) -> dict[str, float]:
    """One number per metric over the PPO epochs: min / max for extrema, the mean for everything else."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for d in per_epoch for k in d):
        values = [float(d[key]) for d in per_epoch if key in d]
        if key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out

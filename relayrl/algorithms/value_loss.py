"""The critic's loss (half MSE to the GAE returns, optionally PPO-clipped around the old values) and the driver-side
reduction of its per-micro-batch metrics (including explained variance).

Unlike the policy losses, the value loss is *not* sliced with `[:, 1:]`: the value model already right-shifts its
head output, so `values[:, t]` = V(s_t) lines up with the token-aligned `returns`, `token_mask` and old `values`.
Every summed metric is divided by the global valid token count, so micro-batch values add up to the global mean.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from relayrl.algorithms.interfaces import LossType, MetricNormalizer
from relayrl.algorithms.utils import masked_mean

Count = torch.Tensor | float

#: Critic metrics that are identical on every micro-batch (or per-step already) and therefore averaged.
AVERAGED_CRITIC_METRICS = frozenset({"lr", "wd", "grad_norm"})


class MseValueLossFn:
    """L = 1/2 * scale * sum(max((v - R)^2, (v_clip - R)^2) * m) / N_t, v_clip = clamp(v, v_old - eps, v_old + eps).

    Without `value_clip` (None or 0) only the unclipped term is used. The clip keeps one PPO epoch from moving the
    critic far from the values the advantages were computed with.
    """

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self, scale: float = 1.0, value_clip: float | None = None) -> None:
        if value_clip is not None and value_clip < 0:
            raise ValueError(f"value_clip must be >= 0 or None, got {value_clip}")
        self.scale = scale
        self.value_clip = value_clip
        tok, none = MetricNormalizer.TOKENS, MetricNormalizer.NONE
        self.metric_normalizations: dict[str, MetricNormalizer] = {
            "loss": tok,
            "vf_clipfrac": tok,
            "returns_mean": tok,
            "values_mean": tok,
            "returns_sq_mean": tok,
            "residual_sq_mean": tok,
            "values_min": none,
            "values_max": none,
            "num_valid_samples": none,
        }

    @property
    def clipping(self) -> bool:
        return self.value_clip is not None and self.value_clip > 0

    def __call__(
        self,
        model_output: torch.Tensor,  # [B, S] or [B, S, 1] right-shifted value predictions, with grad
        data: dict[str, Any],  # returns, values (old), token_mask [B, S]; sample_mask [B]
        global_valid_seqs: Count,
        global_valid_toks: Count,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        v = model_output.squeeze(-1) if model_output.dim() == 3 else model_output  # [B, S]
        if not v.is_floating_point():
            v = v.float()
        returns = data["returns"].to(device=v.device, dtype=v.dtype)  # [B, S]
        sm = data["sample_mask"].to(device=v.device, dtype=v.dtype)  # [B]
        m = data["token_mask"].to(device=v.device, dtype=v.dtype) * sm.unsqueeze(-1)  # [B, S]
        n_t = global_valid_toks

        sq_err = (v - returns).square()  # [B, S]
        if self.clipping:
            assert self.value_clip is not None
            old = data["values"].to(device=v.device, dtype=v.dtype)  # [B, S]
            v_clipped = torch.clamp(v, old - self.value_clip, old + self.value_clip)  # [B, S]
            sq_err_clipped = (v_clipped - returns).square()  # [B, S]
            per_token = torch.maximum(sq_err, sq_err_clipped)  # [B, S]
            clipfrac = masked_mean((sq_err_clipped > sq_err).to(v.dtype), m, global_normalization_factor=n_t)
        else:
            per_token = sq_err
            clipfrac = torch.zeros((), dtype=v.dtype, device=v.device)
        loss = 0.5 * self.scale * masked_mean(per_token, m, global_normalization_factor=n_t)

        with torch.no_grad():
            vd = v.detach()
            valid = m > 0  # [B, S]
            has_valid = bool(valid.any())
            metrics: dict[str, Any] = {
                "loss": loss.item(),
                "vf_clipfrac": clipfrac.item(),
                "returns_mean": masked_mean(returns, m, global_normalization_factor=n_t).item(),
                "values_mean": masked_mean(vd, m, global_normalization_factor=n_t).item(),
                "returns_sq_mean": masked_mean(returns.square(), m, global_normalization_factor=n_t).item(),
                "residual_sq_mean": masked_mean((vd - returns).square(), m, global_normalization_factor=n_t).item(),
                "values_min": vd[valid].min().item() if has_valid else math.inf,
                "values_max": vd[valid].max().item() if has_valid else -math.inf,
                "num_valid_samples": sm.sum().item(),
            }
        return loss, metrics


def _metric_floats(key: str, raw: Any) -> list[float]:
    """Flatten one metric's micro-batch entries (numbers, tensors, arrays, nested lists) into floats."""
    if isinstance(raw, bool) or isinstance(raw, (str, bytes, dict)) or raw is None:
        raise ValueError(f"Unknown metric type for {key!r}: {type(raw).__name__}")
    if isinstance(raw, numbers.Real):
        return [float(raw)]
    if isinstance(raw, torch.Tensor):
        if raw.is_complex():
            raise ValueError(f"Unknown metric type for {key!r}: complex tensor")
        return [float(x) for x in raw.detach().flatten().tolist()]
    if hasattr(raw, "tolist") and not isinstance(raw, (list, tuple)):  # numpy arrays and scalars
        return _metric_floats(key, raw.tolist())
    if isinstance(raw, (list, tuple)):
        out: list[float] = []
        for item in raw:
            out.extend(_metric_floats(key, item))
        return out
    raise ValueError(f"Unknown metric type for {key!r}: {type(raw).__name__}")


def explained_variance(
    returns_mean: float, values_mean: float, returns_sq_mean: float, residual_sq_mean: float
) -> float:
    """1 - Var(R - v) / Var(R) from global first and second moments (Var(R) floored at 1e-8)."""
    residual_var = residual_sq_mean - (returns_mean - values_mean) ** 2
    returns_var = max(returns_sq_mean - returns_mean**2, 1e-8)
    return 1.0 - residual_var / returns_var


def reduce_critic_metrics(all_mb_metrics: dict[str, Any]) -> dict[str, float]:
    """Reduce the value trainer's per-micro-batch metric lists to one number each (driver side, unprefixed).

    lr / wd / grad_norm / global_valid_* are averaged, `*_min` / `*_max` take the min / max over finite entries
    (-1 when none), everything else is summed (loss metrics are already partial sums of the global mean). When the
    four moment metrics are present, `explained_var` is added. Non-numeric entries raise ValueError.
    """
    out: dict[str, float] = {}
    for key, raw in all_mb_metrics.items():
        values = _metric_floats(key, raw)
        if key in AVERAGED_CRITIC_METRICS or key.startswith("global_valid_"):
            out[key] = sum(values) / len(values) if values else 0.0
        elif key.endswith("_min") or key.endswith("_max"):
            finite = [x for x in values if math.isfinite(x)]
            out[key] = (min(finite) if key.endswith("_min") else max(finite)) if finite else -1.0
        else:
            out[key] = float(sum(values))
    moments = ("returns_mean", "values_mean", "returns_sq_mean", "residual_sq_mean")
    if all(k in out for k in moments):
        out["explained_var"] = explained_variance(*(out[k] for k in moments))
    return out

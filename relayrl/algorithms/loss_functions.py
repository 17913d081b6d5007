"""Policy losses: the clipped policy-gradient family (PPO/GRPO, DAPO clip-higher, dual clip, GSPO, CISPO, REINFORCE,
truncated importance sampling) with an optional reference-KL penalty, and plain NLL for SFT / evaluation.

Every loss is a *partial sum* of the global-batch mean: it divides by the global valid token / sequence counts the
caller passes, so summing micro-batch losses (and per-micro-batch metrics) reproduces the full-batch value exactly.
Inputs follow the token-aligned convention: `next_token_logprobs[:, t]` predicts token t+1, so every [B, S]
tensor from `data` is sliced with `[:, 1:]` (the first token is never trained).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from relayrl.algorithms.interfaces import LossType, MetricNormalizer
from relayrl.algorithms.utils import calculate_kl, masked_mean
from relayrl.config import ClippedPGLossConfig

#: ln 2 as a Python float: subtracted from float32 tensors it rounds to what `torch.log(tensor(2.0))` gives.
LOG_2 = math.log(2.0)
TIS_TYPES = ("tis", "icepop", "seq-mask-tis")
Count = torch.Tensor | float


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _check_config(cfg: ClippedPGLossConfig) -> None:
    """Reject flag combinations that would silently compute something else (reference assertions, as ValueError)."""

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    if cfg.sequence_level_importance_ratios:
        require(
            not cfg.token_level_loss,
            "sequence-level importance sampling (e.g. GSPO) is mutually exclusive with token-level loss; "
            "set token_level_loss=False",
        )
    if cfg.use_cispo:
        require(not cfg.disable_ppo_ratio, "use_cispo is incompatible with disable_ppo_ratio")
        require(not cfg.force_on_policy_ratio, "use_cispo is incompatible with force_on_policy_ratio")
        require(
            not cfg.sequence_level_importance_ratios, "use_cispo is incompatible with sequence_level_importance_ratios"
        )
        require(cfg.ratio_clip_c is None, "use_cispo is incompatible with dual clipping (ratio_clip_c)")
        require(cfg.token_level_loss, "use_cispo requires token_level_loss=True")
    tis_type, hi, lo = (
        cfg.truncated_importance_sampling_type,
        cfg.truncated_importance_sampling_ratio,
        cfg.truncated_importance_sampling_ratio_min,
    )
    if tis_type is None:
        require(hi is None, "truncated_importance_sampling_ratio requires truncated_importance_sampling_type")
        return
    require(
        cfg.use_importance_sampling_correction,
        "truncated importance sampling is only supported when use_importance_sampling_correction is True",
    )
    require(tis_type in TIS_TYPES, f"truncated_importance_sampling_type must be one of {TIS_TYPES}, got {tis_type!r}")
    require(hi is not None and hi > 0, "truncated_importance_sampling_ratio should be positive")
    if lo is not None:
        require(
            hi is not None and lo <= hi,
            "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio",
        )
    if tis_type in ("icepop", "seq-mask-tis"):
        require(lo is not None, f"truncated_importance_sampling_ratio_min must be set for {tis_type!r}")
    if tis_type == "seq-mask-tis":
        require(
            not cfg.sequence_level_importance_ratios,
            "seq-mask-tis is incompatible with sequence_level_importance_ratios=True",
        )


class ClippedPGLossFn:
    """Clipped policy-gradient loss with optional reference-KL penalty; see the module docstring for the variants.

    Loss = actor term (pessimistic PPO clip, optionally importance-weighted by pi_prev / pi_gen) + beta * KL(pi || ref)
    + positive-example NLL weight * NLL(rewarded rows). Aggregation is token level (over all valid tokens of the
    global batch) or sequence level (per-sequence token mean, then over valid sequences).
    """

    def __init__(self, cfg: ClippedPGLossConfig) -> None:
        _check_config(cfg)
        self.cfg = cfg
        # With the KL folded into the reward (Reinforce++), the loss must not penalise it a second time.
        self.kl_coef = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
        self.loss_type = LossType.TOKEN_LEVEL if cfg.token_level_loss else LossType.SEQUENCE_LEVEL
        self.metric_normalizations = self._metric_normalizations()

    def _metric_normalizations(self) -> dict[str, MetricNormalizer]:
        """What each metric was divided by, so trainers running with placeholder counts can rescale afterwards."""
        tok, seq, none = MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES, MetricNormalizer.NONE
        grad = tok if self.loss_type == LossType.TOKEN_LEVEL else seq
        out = {"loss": grad, "kl_penalty": grad}
        for key in ("probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error", "policy_kl_error"):
            out[key] = tok
        out["js_divergence_error"] = tok
        out["approx_entropy"] = tok
        out["sampling_importance_ratio"] = seq if self.cfg.sequence_level_importance_ratios else tok
        for key in ("num_valid_samples", "positive_nll_loss", "probs_ratio_min", "probs_ratio_max"):
            out[key] = none
        out["probs_ratio_clamped_min"] = none
        out["probs_ratio_clamped_max"] = none
        if self.cfg.truncated_importance_sampling_type is not None:
            out["is_oob_ratio"] = seq if self.cfg.truncated_importance_sampling_type == "seq-mask-tis" else tok
        return out

    def _reduce(self, per_token: torch.Tensor, tm: torch.Tensor, sm: torch.Tensor, n_seqs: Count, n_toks: Count):
        """Token level: sum over valid tokens / N_t. Sequence level: sum over valid rows of the row's token mean / N_s."""
        if self.loss_type == LossType.TOKEN_LEVEL:
            return masked_mean(per_token, tm * sm.unsqueeze(-1), global_normalization_factor=n_toks)
        return masked_mean(masked_mean(per_token, tm, dim=-1), sm, global_normalization_factor=n_seqs)

    @torch.no_grad()
    def _mismatch_diagnostics(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, n_toks: Count) -> dict:
        """How far the training forward (prev) and the generation engine (gen) disagree; token-normalised."""
        kl_type = self.cfg.reference_policy_kl_type

        def tok_mean(x: torch.Tensor) -> torch.Tensor:
            return masked_mean(x, m, global_normalization_factor=n_toks)

        # Jensen-Shannon against the mixture M = (P_prev + P_gen) / 2, per sampled token (k3-style terms).
        log_mix = torch.logaddexp(p, g) - LOG_2  # a Python scalar: no host-to-device copy per micro-batch
        js = 0.5 * ((p - log_mix).exp() - (p - log_mix) - 1) + 0.5 * ((g - log_mix).exp() - (g - log_mix) - 1)
        return {
            "token_mult_prob_error": tok_mean(torch.exp((g - p).abs() * m)),  # 1.0 == perfect agreement
            "gen_kl_error": tok_mean(calculate_kl(g, p, kl_type, None, None)),
            "policy_kl_error": tok_mean(calculate_kl(p, g, kl_type, None, None)),
            "js_divergence_error": tok_mean(js),
        }

    def _importance_weights(
        self, p: torch.Tensor, g: torch.Tensor, tm: torch.Tensor, sm: torch.Tensor, n_seqs: Count, n_toks: Count
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Actor importance weights pi_prev / pi_gen ([B, S-1], or [B, 1] for GSPO), truncated per the TIS type."""
        cfg = self.cfg
        m = tm * sm.unsqueeze(-1)  # [B, S-1]
        if cfg.sequence_level_importance_ratios:
            # GSPO weights use the *sum* of log-ratios (the ratio itself uses the mean) - reference behaviour.
            w = _finite_or_zero(torch.exp(((p - g) * m).sum(dim=-1, keepdim=True))).detach()  # [B, 1]
        else:
            w = _finite_or_zero(torch.exp(p - g)).detach()  # [B, S-1]
        kind = cfg.truncated_importance_sampling_type
        metrics: dict[str, torch.Tensor] = {}
        if kind is None or cfg.truncated_importance_sampling_ratio is None:
            return w, metrics
        # Construction guarantees the upper bound, and the lower bound for icepop / seq-mask-tis; tis defaults it to 0.
        hi = cfg.truncated_importance_sampling_ratio
        lo = cfg.truncated_importance_sampling_ratio_min or 0.0
        if kind == "tis":
            oob = ((w > hi) | (w < lo)).to(m.dtype)
            metrics["is_oob_ratio"] = masked_mean(oob, m, global_normalization_factor=n_toks)
            w = w.clamp(min=lo, max=hi)
        elif kind == "icepop":
            keep = ((w >= lo) & (w <= hi)).to(m.dtype)
            metrics["is_oob_ratio"] = masked_mean(1 - keep, m, global_normalization_factor=n_toks)
            w = w * keep
        elif kind == "seq-mask-tis":
            # Whole sequences are kept or dropped on their geometric-mean ratio; kept ones keep raw token weights.
            geo = torch.exp(masked_mean(_finite_or_zero(p - g), tm, dim=-1)).detach()  # [B]
            keep_seq = ((geo >= lo) & (geo <= hi)).to(m.dtype)  # [B]
            metrics["is_oob_ratio"] = masked_mean(1 - keep_seq, sm, global_normalization_factor=n_seqs)
            w = w * keep_seq.unsqueeze(-1)
        return w, metrics

    def __call__(
        self,
        next_token_logprobs: torch.Tensor,  # [B, S-1] current policy, with grad
        data: dict[str, Any],
        global_valid_seqs: Count,
        global_valid_toks: Count,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        c = next_token_logprobs  # [B, S-1]
        tm = data["token_mask"][:, 1:].to(c.dtype)  # [B, S-1]
        sm = data["sample_mask"].to(c.dtype)  # [B]
        m = tm * sm.unsqueeze(-1)  # [B, S-1]
        adv = data["advantages"][:, 1:].to(c.dtype)  # [B, S-1]
        g = data["generation_logprobs"][:, 1:].to(c.dtype)  # [B, S-1]
        p = c.detach() if cfg.force_on_policy_ratio else data["prev_logprobs"][:, 1:].to(c.dtype)  # [B, S-1]
        n_s, n_t = global_valid_seqs, global_valid_toks

        metrics: dict[str, Any] = self._mismatch_diagnostics(p, g, m, n_t)

        # ---- reference KL penalty ----
        kl = c.new_zeros(())
        if self.kl_coef != 0:
            c_u = data.get("curr_logprobs_unfiltered")
            c_u = c if c_u is None else c_u  # [B, S-1]; unfiltered by top-k/p, matching the reference logprobs
            q = data["reference_policy_logprobs"][:, 1:].to(c.dtype)  # [B, S-1]
            # exp(x - x.detach()) == 1 but carries the score-function gradient of sampling from pi itself.
            w_kl = torch.exp(c_u - g) if cfg.use_on_policy_kl_approximation else torch.exp(c_u - c_u.detach())
            kl_tok = self.kl_coef * calculate_kl(
                c_u,
                q,
                cfg.reference_policy_kl_type,
                cfg.kl_input_clamp_value,
                cfg.kl_output_clamp_value,
                _finite_or_zero(w_kl),
            )  # [B, S-1]
            kl = self._reduce(kl_tok, tm, sm, n_s, n_t)

        # ---- ratios ----
        if cfg.force_on_policy_ratio:
            ratio = torch.exp(c - c.detach())  # == 1, keeps the gradient of c
            ratio_c = ratio
        elif not cfg.disable_ppo_ratio:
            if cfg.sequence_level_importance_ratios:
                seq_log_ratio = masked_mean(c - p, tm, dim=-1)  # [B]; token mask only, as in the reference
                ratio = torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(c)  # [B, S-1]
            else:
                ratio = torch.exp(c - p)  # [B, S-1]
            ratio_c = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        else:  # REINFORCE: the "ratio" is the log-prob itself, so -A * ratio is the score-function surrogate
            ratio = ratio_c = c

        # ---- surrogate ----
        if cfg.use_cispo:
            pg = -adv * ratio_c.detach() * c
        else:
            pg = torch.maximum(-adv * ratio, -adv * ratio_c)
        if cfg.ratio_clip_c is not None:
            if cfg.ratio_clip_c <= 1:
                raise ValueError(f"ratio_clip_c must exceed 1, got {cfg.ratio_clip_c}")
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.ratio_clip_c), pg)

        # ---- importance-sampling correction and actor loss ----
        w, is_metrics = self._importance_weights(p, g, tm, sm, n_s, n_t)
        w_use = w if cfg.use_importance_sampling_correction else torch.ones_like(c)
        actor_loss = self._reduce(w_use * pg, tm, sm, n_s, n_t)

        # ---- VAPO positive-example NLL (only when rewards are in the batch) ----
        nll = c.new_zeros(())
        rewards = data.get("rewards")
        if cfg.positive_example_nll_weight > 0 and rewards is not None:
            m_pos = m * (rewards > 0).to(m.dtype).unsqueeze(-1)  # [B, S-1]
            n_pos = m_pos.sum()
            if n_pos > 0:
                nll = masked_mean(-c, m_pos, global_normalization_factor=n_pos)

        loss = actor_loss + kl + cfg.positive_example_nll_weight * nll
        metrics.update(self._policy_metrics(c, g, ratio, ratio_c, w, m, sm, n_s, n_t))
        metrics.update(is_metrics)
        metrics.update(loss=loss, kl_penalty=kl, positive_nll_loss=nll)
        metrics = _to_host(metrics)  # one device-to-host copy for the micro-batch's metrics
        kl_value = metrics["kl_penalty"]
        metrics["kl_penalty"] = kl_value / self.kl_coef if self.kl_coef != 0 and kl_value != 0 else 0.0
        return loss, metrics

    @torch.no_grad()
    def _policy_metrics(self, c, g, ratio, ratio_c, w, m, sm, n_s: Count, n_t: Count) -> dict[str, Any]:
        if self.cfg.sequence_level_importance_ratios:
            # One weight per row, averaged over valid rows (the reference's B x B broadcast here is not reproduced).
            sampling_ratio = masked_mean(w.squeeze(-1), sm, global_normalization_factor=n_s)
        else:
            sampling_ratio = masked_mean(w, m, global_normalization_factor=n_t)
        valid = m.bool()
        r_valid, rc_valid = ratio.detach()[valid], ratio_c.detach()[valid]
        has = r_valid.numel() > 0
        inf = float("inf")
        return {
            "probs_ratio": masked_mean(ratio.detach(), m, global_normalization_factor=n_t),
            "probs_ratio_clamped": masked_mean(ratio_c.detach(), m, global_normalization_factor=n_t),
            "probs_ratio_min": r_valid.min() if has else inf,
            "probs_ratio_max": r_valid.max() if has else -inf,
            "probs_ratio_clamped_min": rc_valid.min() if has else inf,
            "probs_ratio_clamped_max": rc_valid.max() if has else -inf,
            "sampling_importance_ratio": sampling_ratio,
            "num_valid_samples": sm.sum(),
            # E_gen[-(pi / pi_gen) log pi]: an entropy estimate from sampled tokens only.
            "approx_entropy": -masked_mean(torch.exp(c - g) * c, m, global_normalization_factor=n_t),
        }


def _to_host(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics' tensors as Python floats through one device-to-host copy (each `.item()` is a sync on a GPU).
    Widening to float64 first is exact for every float dtype, so the values are those `.item()` gives."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if keys:
        values = torch.stack([metrics[k].detach().reshape(()).double() for k in keys]).tolist()  # [K] -> host
        metrics = {**metrics, **dict(zip(keys, values, strict=True))}
    return metrics


class NLLLossFn:
    """Mean negative log-likelihood over valid next tokens (SFT, evaluation), normalised by the global token count."""

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self) -> None:
        self.metric_normalizations: dict[str, MetricNormalizer] = {
            "loss": MetricNormalizer.TOKENS,
            "num_unmasked_tokens": MetricNormalizer.NONE,
            "num_valid_samples": MetricNormalizer.NONE,
        }

    def __call__(
        self,
        next_token_logprobs: torch.Tensor,  # [B, S-1]
        data: dict[str, Any],
        global_valid_seqs: Count,
        global_valid_toks: Count,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        c = next_token_logprobs
        sm = data["sample_mask"].to(c.dtype)  # [B]
        m = data["token_mask"][:, 1:].to(c.dtype) * sm.unsqueeze(-1)  # [B, S-1]
        loss = -masked_mean(c, m, global_normalization_factor=global_valid_toks)
        return loss, {
            "loss": loss.item(),
            "num_unmasked_tokens": m.sum().item(),
            "num_valid_samples": sm.sum().item(),
        }

"""Generalized Advantage Estimation for PPO, with the VAPO options (decoupled lambda, length-adaptive lambda).

Inputs follow the token-aligned layout: `mask[:, t]` marks token t as a trained (generated) token and `values[:, t]`
is V(s_t), the value of the state *before* token t is emitted (the value model right-shifts its head output). The
scalar outcome reward lands on the last valid token of each row. The backward recursion carries the next value and
the running advantage over masked positions, so a masked gap (e.g. an environment observation between two
assistant turns) behaves exactly as if it had been cut out of the sequence.

`compute_gae` is a free function (no config object) so configs can evolve without touching the math. The PPO
estimators built on it and the sharded whitening the data-plane critic runs on its workers live here too, so the
value workers import math, never a trainer.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from relayrl.algorithms.utils import calculate_kl, masked_mean, masked_var
from relayrl.config import ClippedPGLossConfig, PPOAdvEstimatorConfig


def last_valid_positions(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position where mask != 0 in each row, -1 for rows without any valid token."""
    s = mask.shape[1]
    positions = torch.arange(s, device=mask.device).expand_as(mask)  # [B, S]
    return torch.where(mask != 0, positions, torch.full_like(positions, -1)).max(dim=1).values  # [B]


def place_terminal_rewards(
    rewards: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, S]
    token_rewards: torch.Tensor | None = None,  # [B, S]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Token rewards rho [B, S]: optional per-token rewards plus the scalar reward on the last valid token, masked."""
    maskf = mask.to(dtype)  # [B, S]
    rho = torch.zeros(mask.shape, dtype=dtype, device=mask.device)  # [B, S]
    if token_rewards is not None:
        rho = rho + token_rewards.to(device=mask.device, dtype=dtype)
    last = last_valid_positions(mask)  # [B]
    has_valid = last >= 0  # [B]
    rows = torch.arange(mask.shape[0], device=mask.device)[has_valid]  # [B']
    terminal = rewards.to(device=mask.device, dtype=dtype)[has_valid]  # [B']
    rho = rho.index_put((rows, last[has_valid]), terminal, accumulate=True)
    return rho * maskf  # [B, S]


def compute_gae(
    rewards: torch.Tensor,  # [B]
    values: torch.Tensor,  # [B, S]
    mask: torch.Tensor,  # [B, S]
    gamma: float,
    lam: float | torch.Tensor,  # scalar or per-row [B]
    token_rewards: torch.Tensor | None = None,  # [B, S], e.g. -beta * KL
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, S]; advantages are 0 at masked positions and returns = advantages + values.

    Backward recursion, vectorised over rows: delta = rho_t + gamma * nextV - V_t, A_hat = delta + gamma * lam * A;
    only valid positions update (nextV, A), so masked positions are transparent. Rows with no valid token get 0.
    """
    dtype = values.dtype if values.is_floating_point() else torch.float32
    vals = values.to(dtype)  # [B, S]
    valid = mask != 0  # [B, S]
    rho = place_terminal_rewards(rewards, mask, token_rewards, dtype)  # [B, S]
    batch, seq = vals.shape
    if isinstance(lam, torch.Tensor):
        gamma_lam: float | torch.Tensor = gamma * lam.to(device=vals.device, dtype=dtype).reshape(batch)  # [B]
    else:
        gamma_lam = gamma * lam

    next_value = torch.zeros(batch, dtype=dtype, device=vals.device)  # [B]
    running = torch.zeros(batch, dtype=dtype, device=vals.device)  # [B]
    advantages = torch.zeros(batch, seq, dtype=dtype, device=vals.device)  # [B, S]
    for t in range(seq - 1, -1, -1):
        v_t = vals[:, t]  # [B]
        delta = rho[:, t] + gamma * next_value - v_t  # [B]
        candidate = delta + gamma_lam * running  # [B]
        valid_t = valid[:, t]  # [B]
        next_value = torch.where(valid_t, v_t, next_value)
        running = torch.where(valid_t, candidate, running)
        advantages[:, t] = torch.where(valid_t, running, torch.zeros_like(running))
    return advantages, advantages + vals


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(v - masked mean) * rsqrt(unbiased masked var + 1e-8), zero at masked positions.

    The unbiased variance matches the reference's GAE whitening; with a single valid entry the result is 0.
    """
    dtype = values.dtype if values.is_floating_point() else torch.float32
    vals = values.to(dtype)  # [B, S]
    maskf = mask.to(dtype)  # [B, S]
    mean = masked_mean(vals, maskf)
    var = masked_var(vals, maskf, mean=mean, unbiased=True)
    return (vals - mean) * torch.rsqrt(var + 1e-8) * maskf  # [B, S]


def length_adaptive_lambda(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO per-row policy lambda [B]: clamp(1 - 1 / max(alpha * len, 1), 0, 1), len = number of valid tokens.

    Longer responses get a lambda closer to 1 so the terminal reward still reaches their early tokens.
    """
    lengths = (mask != 0).sum(dim=1).to(torch.float32)  # [B]
    scaled = (alpha * lengths).clamp(min=1.0)  # [B]
    return (1.0 - 1.0 / scaled).clamp(0.0, 1.0)  # [B]


class GeneralizedAdvantageEstimator:
    """PPO advantage estimator: GAE over terminal (+ optional -beta * KL) token rewards, optionally whitened.

    Any of the VAPO options (`lam_value`, `lam_policy`, `length_adaptive_alpha`) decouples actor and critic: the
    returns (critic targets) come from a run with lambda_value, the advantages from a run with lambda_policy or the
    length-adaptive per-row lambda. `None` means "not set" (0.0 is a legitimate lambda).
    """

    def __init__(
        self,
        gamma: float,
        lam: float,
        normalize_advantages: bool,
        lam_value: float | None = None,
        lam_policy: float | None = None,
        length_adaptive_alpha: float | None = None,
        use_kl_in_reward: bool = False,
        kl_coef: float = 0.0,
        kl_type: str = "k3",
    ) -> None:
        for name, value in (("lam", lam), ("lam_value", lam_value), ("lam_policy", lam_policy)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"GAE {name} must lie in [0, 1], got {value}")
        if length_adaptive_alpha is not None and length_adaptive_alpha < 0:
            raise ValueError(f"length_adaptive_alpha must be >= 0, got {length_adaptive_alpha}")
        self.gamma = gamma
        self.lam = lam
        self.normalize_advantages = normalize_advantages
        self.lam_value = lam_value
        self.lam_policy = lam_policy
        self.length_adaptive_alpha = length_adaptive_alpha
        self.use_kl_in_reward = use_kl_in_reward
        self.kl_coef = kl_coef
        self.kl_type = kl_type

    @property
    def decoupled(self) -> bool:
        """True when any VAPO option is set: GAE then runs twice (critic targets, actor advantages)."""
        return any(x is not None for x in (self.lam_value, self.lam_policy, self.length_adaptive_alpha))

    def policy_lambda(self, mask: torch.Tensor) -> float | torch.Tensor:
        """Lambda for the advantages: per-row length-adaptive when alpha > 0, else lam_policy, else lam."""
        if self.length_adaptive_alpha is not None and self.length_adaptive_alpha > 0:
            return length_adaptive_lambda(mask, self.length_adaptive_alpha)  # [B]
        return self.lam_policy if self.lam_policy is not None else self.lam

    def value_lambda(self) -> float:
        return self.lam_value if self.lam_value is not None else self.lam

    def kl_token_rewards(
        self,
        logprobs_policy: torch.Tensor | None,  # [B, S]
        logprobs_reference: torch.Tensor | None,  # [B, S]
    ) -> torch.Tensor | None:
        """-beta * KL(pi || pi_ref) per token (default clamps 20/10), or None when the KL is not in the reward."""
        if not self.use_kl_in_reward or self.kl_coef <= 0:
            return None
        if logprobs_policy is None or logprobs_reference is None:
            return None
        kl = calculate_kl(logprobs_policy, logprobs_reference, self.kl_type, 20.0, 10.0)  # [B, S]
        return -self.kl_coef * kl.detach()

    def compute_advantage(
        self,
        prompt_ids: torch.Tensor,  # [B, P]; unused, kept for the estimator interface
        rewards: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, S] token_mask * sample_mask, token-aligned
        values: torch.Tensor,  # [B, S] right-shifted value predictions V(s_t)
        logprobs_policy: torch.Tensor | None = None,  # [B, S]
        logprobs_reference: torch.Tensor | None = None,  # [B, S]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages [B, S], returns [B, S]); advantages whitened if configured and always 0 where mask == 0."""
        if values.dim() == 3 and values.shape[-1] == 1:
            values = values.squeeze(-1)
        token_rewards = self.kl_token_rewards(logprobs_policy, logprobs_reference)  # [B, S] | None
        if self.decoupled:
            _, returns = compute_gae(rewards, values, mask, self.gamma, self.value_lambda(), token_rewards)
            advantages, _ = compute_gae(rewards, values, mask, self.gamma, self.policy_lambda(mask), token_rewards)
        else:
            advantages, returns = compute_gae(rewards, values, mask, self.gamma, self.lam, token_rewards)
        if self.normalize_advantages:
            advantages = whiten(advantages, mask)
        return advantages * (mask != 0).to(advantages.dtype), returns


class RawRewardAdvantageEstimator:
    """a = r (minus beta * KL per token when the KL is in the reward), broadcast; optionally whitened over the mask.

    The critic still needs targets, so the returns are the discounted Monte-Carlo returns (GAE with lambda = 1),
    which do not depend on the values.
    """

    def __init__(self, gamma: float, normalize_advantages: bool, kl: GeneralizedAdvantageEstimator) -> None:
        self.gamma = gamma
        self.normalize_advantages = normalize_advantages
        self._kl = kl  # only its KL-in-reward settings are used

    def compute_advantage(
        self,
        prompt_ids: torch.Tensor,  # [B, P]; unused, kept for the estimator interface
        rewards: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, S]
        values: torch.Tensor,  # [B, S]
        logprobs_policy: torch.Tensor | None = None,  # [B, S]
        logprobs_reference: torch.Tensor | None = None,  # [B, S]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        token_rewards = self._kl.kl_token_rewards(logprobs_policy, logprobs_reference)  # [B, S] | None
        adv = rewards.to(torch.float32).unsqueeze(-1).expand(-1, mask.shape[1])  # [B, S]
        if token_rewards is not None:
            adv = adv + token_rewards.to(adv.dtype)
        if self.normalize_advantages:
            maskf = mask.to(adv.dtype)  # [B, S]
            count = maskf.sum().clamp(min=1.0)
            mean = (adv * maskf).sum() / count
            var = ((adv - mean).square() * maskf).sum() / count
            adv = (adv - mean) * torch.rsqrt(var.clamp(min=1e-8))
        _, returns = compute_gae(rewards, values.to(torch.float32), mask, self.gamma, 1.0, token_rewards)
        return adv, returns


def build_ppo_advantage_estimator(
    adv_cfg: PPOAdvEstimatorConfig, loss_cfg: ClippedPGLossConfig
) -> GeneralizedAdvantageEstimator | RawRewardAdvantageEstimator:
    """GAE (default) or raw reward, as named by `ppo.adv_estimator.name`; the KL goes into the reward if configured."""
    gae = GeneralizedAdvantageEstimator(
        gamma=adv_cfg.gae_gamma,
        lam=adv_cfg.gae_lambda,
        normalize_advantages=adv_cfg.normalize_advantages,
        lam_value=adv_cfg.gae_lambda_value,
        lam_policy=adv_cfg.gae_lambda_policy,
        length_adaptive_alpha=adv_cfg.length_adaptive_alpha,
        use_kl_in_reward=loss_cfg.use_kl_in_reward,
        kl_coef=loss_cfg.reference_policy_kl_penalty,
        kl_type=loss_cfg.reference_policy_kl_type,
    )
    if adv_cfg.name == "gae":
        return gae
    if adv_cfg.name == "raw_reward":
        return RawRewardAdvantageEstimator(adv_cfg.gae_gamma, adv_cfg.normalize_advantages, gae)
    raise ValueError(f"PPO only supports 'gae' or 'raw_reward' advantage estimators, got {adv_cfg.name!r}")


def require_valid_tokens(mask: torch.Tensor) -> None:
    """A step whose filters removed every response token cannot train either model: fail loudly, not silently."""
    if not bool((mask != 0).any()):
        raise RuntimeError(
            "no valid response tokens after filtering (every row truncated, masked by loss_multiplier or by "
            "ppo.seq_logprob_error_threshold); raise policy.generation.max_new_tokens or disable ppo.overlong_filtering"
        )


def advantage_value_metrics(
    advantages: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Advantage extrema and the mean advantage / return / value over the trained tokens."""
    valid = advantages[mask.bool()]
    maskf = mask.float()  # [B, S]
    return {
        "advantages/mean": valid.mean().item() if valid.numel() else 0.0,
        "advantages/max": valid.max().item() if valid.numel() else 0.0,
        "advantages/min": valid.min().item() if valid.numel() else 0.0,
        "returns/mean": float(masked_mean(returns.float(), maskf)),
        "values/mean": float(masked_mean(values.float(), maskf)),
    }


# ---------------------------------------------------------------------------------------------------- sharded GAE
# The data-plane trainer runs the estimator on the value workers, each on its own rows. GAE itself is row-local;
# only the optional whitening is a batch-wide reduction. One shard (dp=1) runs `compute_advantage` unchanged, so its
# numbers equal the legacy trainer's bit for bit; with several shards the workers first write raw advantages and
# return float64 moments, the driver sums them, and a second pass whitens with the global mean and variance.


def without_normalization(estimator: Any) -> Any:
    """A shallow copy of `estimator` that skips whitening (the raw pass of the sharded computation)."""
    raw = copy.copy(estimator)
    raw.normalize_advantages = False
    return raw


def advantage_moments(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[3] float64 (sum m, sum a*m, sum a^2*m) over a shard: summed over shards they give the batch moments."""
    a, m = advantages.double(), mask.double()  # [B, S]
    return torch.stack([m.sum(), (a * m).sum(), (a * a * m).sum()])


def whiten_with_moments(
    advantages: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor | list[float], estimator: Any
) -> torch.Tensor:
    """Whiten raw advantages `[B, S]` with batch moments, by the estimator's own rule: GAE's `whiten` (unbiased
    variance, + 1e-8, zero off the mask) or the raw-reward estimator's (biased variance floored at 1e-8)."""
    n, s, q = (float(x) for x in moments)
    raw_reward = isinstance(estimator, RawRewardAdvantageEstimator)
    count = max(n, 1.0) if raw_reward else n + 1e-8
    mean = s / count
    var = max(q / count - mean * mean, 0.0)  # biased
    if raw_reward:
        return (advantages - mean) * max(var, 1e-8) ** -0.5
    if n > 1:
        var = var * n / (n - 1)
    maskf = mask.to(advantages.dtype)  # [B, S]
    return (advantages - mean) * (var + 1e-8) ** -0.5 * maskf * (mask != 0).to(advantages.dtype)


def shard_advantage_stats(
    advantages: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> dict[str, Any]:
    """A shard's `advantage_value_metrics` plus the weights that combine shards (valid count, mask sum)."""
    return {
        "metrics": advantage_value_metrics(advantages, returns, values, mask),
        "num_valid": int((mask != 0).sum()),
        "mask_sum": float(mask.float().sum()),
    }


def combine_advantage_stats(parts: list[dict[str, Any]]) -> dict[str, float]:
    """Batch metrics from per-shard stats: one shard is returned as is (exact); several are weighted by counts."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 1:
        return dict(parts[0]["metrics"])
    valid = [p for p in parts if p["num_valid"]]
    n = sum(p["num_valid"] for p in valid)
    w = sum(p["mask_sum"] for p in parts)
    adv = [p["metrics"] for p in valid]
    return {
        "advantages/mean": sum(m["advantages/mean"] * p["num_valid"] for m, p in zip(adv, valid)) / n if n else 0.0,
        "advantages/max": max((m["advantages/max"] for m in adv), default=0.0),
        "advantages/min": min((m["advantages/min"] for m in adv), default=0.0),
        "returns/mean": sum(p["metrics"]["returns/mean"] * p["mask_sum"] for p in parts) / w if w else 0.0,
        "values/mean": sum(p["metrics"]["values/mean"] * p["mask_sum"] for p in parts) / w if w else 0.0,
    }

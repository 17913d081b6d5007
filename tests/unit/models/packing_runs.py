"""Runs shared by the packing equivalence tests (local and Ray executors): the same skewed batch through a policy or a
critic with sequence packing, dynamic batching or neither, on the legacy façades and on the data plane.

Tolerances, derived from float32 rounding with the model of tests.helpers: a float32 reduction of n terms of size
<= s, evaluated in another order, moves by at most f32_tol(s, n) = K eps sqrt(n) s (rounding errors independent and
mean-zero; K = 3). A packed or dynamic run evaluates the same expressions as the unpacked one, grouped otherwise
(GEMMs over other token counts, attention over other padded widths, sums over other micro-batches and ranks):

* log-prob: a logit minus the log-sum-exp over the vocabulary: lp_tol = f32_tol(max|lp|, V) (as the engine-vs-policy
  and data-parallel tests bound it); a value: the head's dot product over the hidden size: f32_tol(max|v|, H).
* loss of a global batch, L = sum_t c_t over its N loss tokens: each term reads its own log-prob (value), which moves
  by at most lp_tol, independently of the others, so L moves by K lp_tol sqrt(sum_t (dL/dlp_t)^2), the sensitivities
  taken by autograd at the unpacked inputs (`sensitivity`); the sum itself, reordered, by f32_tol(s / N, N) with
  |c_t| <= s / N; the result's own rounding, eps |L|; from the second train() call on, the weights differ by at most w_tol, which moves L by at most
  K w_tol |grad L| (first order, independent signs).
* gradient norm: every coordinate is a mean over N tokens computed in another order, so the gradient moves by at
  most f32_tol(|g|, N) in norm; the norm itself is one kernel over the same parameter layout on both sides, whose
  cascaded summation adds at most eps log2(P) |g| (Higham's pairwise bound; P parameters).
* weights: tests.helpers.adamw_weight_tol with coordinate tolerance f32_tol(max_grad_norm, N) (clipped gradients).

At the sizes below these come to at most ~8e-6 for loss, gradient norm and weights (tests assert below 1e-5 too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relayrl.algorithms.gae import GeneralizedAdvantageEstimator
from relayrl.algorithms.loss_functions import ClippedPGLossFn
from relayrl.algorithms.value_loss import MseValueLossFn
from relayrl.config import ClippedPGLossConfig, ClusterConfig, DataPlaneConfig, PolicyConfig, ValueConfig
from relayrl.data_plane.column_io import first_write
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.policy.lm_policy import Policy
from relayrl.models.policy.tq_policy import TQPolicy
from relayrl.models.value.lm_value import Value
from relayrl.models.value.tq_value import TQValue
from tests.helpers import EPS_F32, K, f32_tol, trained_weight_tol

#: A skewed batch, one global batch per train() call; row 5 is masked out of the loss.
LENGTHS = torch.tensor([120, 4, 57, 9, 88, 3, 31, 14])
SAMPLE_MASK = torch.tensor([1.0, 1, 1, 1, 1, 0, 1, 1])
SEQ, GBS, MBS, PROMPT = 124, 8, 2, 3
MAX_GRAD_NORM, LR, ADAM_EPS, CALLS = 0.5, 1e-4, 1e-3, 2  # one optimizer step per train() call
BUDGET = 160  # tokens per micro-batch (bin capacity / dynamic budget) in every pass
MODES: dict[str, dict[str, Any]] = {
    "unpacked": {},
    "packing": {"sequence_packing": {"enabled": True, "train_mb_tokens": BUDGET, "logprob_mb_tokens": BUDGET}},
    "dynamic": {
        "dynamic_batching": {
            "enabled": True,
            "train_mb_tokens": BUDGET,
            "logprob_mb_tokens": BUDGET,
            "sequence_length_round": 8,
        }
    },
}
BULK = ("input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask")


def make_batch(vocab: int, seed: int = 0) -> BatchedDataDict:
    """Random tokens right-padded to SEQ; the first PROMPT positions are prompt; one advantage per row (GRPO),
    generation log-probs and returns (for a critic) drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    rows = len(LENGTHS)
    real = torch.arange(SEQ)[None, :] < LENGTHS[:, None]  # [B, S]
    token_mask = real.float()
    token_mask[:, :PROMPT] = 0.0
    return BatchedDataDict(
        input_ids=torch.randint(2, vocab, (rows, SEQ), generator=g).masked_fill(~real, 0),  # [B, S]
        input_lengths=LENGTHS.clone(),  # [B]
        token_mask=token_mask,  # [B, S]
        sample_mask=SAMPLE_MASK.clone(),  # [B]
        advantages=torch.randn(rows, 1, generator=g).expand(rows, SEQ).clone(),  # [B, S]
        generation_logprobs=(-4 * torch.rand(rows, SEQ, generator=g)) * token_mask,  # [B, S]
        returns=torch.randn(rows, SEQ, generator=g) * real,  # [B, S]
    )


def policy_config(model_dir: Path, mode: str, **extra: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        dict(
            **extra,
            model_name=str(model_dir),
            train_global_batch_size=GBS,
            train_micro_batch_size=MBS,
            logprob_batch_size=MBS,
            max_total_sequence_length=SEQ,
            max_grad_norm=MAX_GRAD_NORM,
            optimizer={"kwargs": {"lr": LR, "eps": ADAM_EPS}},
            **MODES[mode],
        )
    )


def value_config(model_dir: Path, mode: str) -> ValueConfig:
    return ValueConfig.model_validate(policy_config(model_dir, mode).model_dump(include=set(ValueConfig.model_fields)))


def pg_loss() -> ClippedPGLossFn:
    return ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.01))


def value_loss() -> MseValueLossFn:
    return MseValueLossFn(1.0, value_clip=0.2)


def ppo_advantages(batch: BatchedDataDict, values: torch.Tensor) -> torch.Tensor:
    """Per-token PPO advantages [B, S] (GAE over the critic's values, rewards = each row's mean return)."""
    mask = batch["token_mask"] * batch["sample_mask"][:, None]  # [B, S]
    rewards = batch["returns"].sum(1) / LENGTHS  # [B]
    gae = GeneralizedAdvantageEstimator(gamma=1.0, lam=0.95, normalize_advantages=True)
    advantages, _ = gae.compute_advantage(torch.zeros(len(LENGTHS), 1), rewards, mask, values)
    return advantages


def to_seq(x: torch.Tensor) -> torch.Tensor:
    """A store read (padded to the longest row) at the legacy batch's width SEQ: [B, SEQ]."""
    return torch.nn.functional.pad(x, (0, SEQ - x.shape[1]))


@dataclass
class Outcome:
    """What a run produced: per-pass outputs, each train() result and the trained weights (rank 0)."""

    passes: dict[str, torch.Tensor] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)


def run_policy(policy: Policy, batch: BatchedDataDict, advantages: torch.Tensor | None = None) -> Outcome:
    """Log-probs, reference log-probs (and top-k on the legacy façade), then two train() calls (GRPO's per-row
    advantages, or PPO's per-token `advantages`), through the legacy API or the data plane."""
    out = Outcome()
    data = batch.copy()
    if advantages is not None:
        data["advantages"] = advantages
    if isinstance(policy, TQPolicy):
        policy.prepare_step(data.size, 2)
        producer = build_data_plane_client(policy.dp_cfg, bootstrap=False)
        keys = [f"p{i // 2}_g{i % 2}" for i in range(data.size)]
        meta = first_write({k: data[k] for k in BULK}, keys=keys, client=producer, partition_id="train")
        producer.close()
        policy.get_logprobs_from_meta(meta)
        policy.get_reference_policy_logprobs_from_meta(meta)
        policy.write_to_dataplane(meta, {"advantages": data["advantages"]})
        got = policy.read_from_dataplane(meta, select_fields=["prev_logprobs", "reference_policy_logprobs"])
        out.passes = {"logprobs": to_seq(got["prev_logprobs"]), "reference": to_seq(got["reference_policy_logprobs"])}
        out.results = [policy.train_from_meta(meta, pg_loss()) for _ in range(CALLS)]
        policy.finish_step(meta)
    else:
        out.passes = {
            "logprobs": policy.get_logprobs(data)["logprobs"],
            "reference": policy.get_reference_policy_logprobs(data)["reference_logprobs"],
            "topk": policy.get_topk_logits(data, 3)["topk_logits"],
        }
        data["prev_logprobs"] = out.passes["logprobs"]
        data["reference_policy_logprobs"] = out.passes["reference"]
        out.results = [policy.train(data, pg_loss()) for _ in range(CALLS)]
    out.weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return out


def run_value(value: Value, batch: BatchedDataDict) -> Outcome:
    """Values, then two critic train() calls (clipped value loss) on the batch's returns."""
    out = Outcome()
    if isinstance(value, TQValue):
        value.prepare_step(batch.size)
        producer = build_data_plane_client(value.dp_cfg, bootstrap=False)
        keys = [f"p{i // 2}_g{i % 2}" for i in range(batch.size)]
        meta = first_write({k: batch[k] for k in BULK}, keys=keys, client=producer, partition_id="train")
        producer.close()
        value.get_values_from_meta(meta)
        out.passes = {"values": to_seq(value.read_from_dataplane(meta, select_fields=["values"])["values"])}
        value.write_to_dataplane(meta, {"returns": batch["returns"]})
        out.results = [value.train_from_meta(meta, value_loss()) for _ in range(CALLS)]
        value.finish_step(meta)
    else:
        out.passes = {"values": value.get_values(batch)["values"]}
        data = BatchedDataDict({**batch, "values": out.passes["values"]})
        out.results = [value.train(data, value_loss()) for _ in range(CALLS)]
    out.weights = {k: v.detach().clone() for k, v in value.state_dict().items()}
    return out


def build(
    kind: str, model: str, model_dir: Path, tokenizer: Any, mode: str, cluster: ClusterConfig, dp_cfg: DataPlaneConfig
) -> Any:
    """A legacy (`kind` = legacy) or data-plane (`tq`) policy or critic (`model` = policy / value)."""
    if model == "policy":
        cfg: Any = policy_config(model_dir, mode)
        return (
            TQPolicy(cfg, tokenizer, cluster=cluster, dp_cfg=dp_cfg)
            if kind == "tq"
            else Policy(cfg, tokenizer, cluster=cluster)
        )
    cfg = value_config(model_dir, mode)
    return (
        TQValue(cfg, tokenizer, cluster=cluster, dp_cfg=dp_cfg)
        if kind == "tq"
        else Value(cfg, tokenizer, cluster=cluster)
    )


# ---------------------------------------------------------------------------------------------------- tolerances
def global_counts(batch: BatchedDataDict, shift: int) -> tuple[float, float]:
    """Valid sequences and loss tokens of the batch (the policy's loss skips position 0: `shift` = 1)."""
    mask = batch["token_mask"][:, shift:] * batch["sample_mask"][:, None]  # [B, S - shift]
    return float(batch["sample_mask"].sum()), float(mask.sum())


def sensitivity(model: str, batch: BatchedDataDict, inputs: torch.Tensor) -> float:
    """sqrt(sum_t (dL/dx_t)^2) of the global batch's loss at the unpacked run's log-probs (values) `inputs`."""
    data = batch.copy()
    seqs, toks = global_counts(batch, 1 if model == "policy" else 0)
    if model == "policy":
        data["prev_logprobs"], data["reference_policy_logprobs"] = inputs, inputs
        x = inputs[:, 1:].clone().requires_grad_(True)  # [B, S-1] next-token log-probs
        loss, _ = pg_loss()(x, data, seqs, toks)
    else:
        data["values"] = inputs
        x = inputs.clone().requires_grad_(True)  # [B, S]
        loss, _ = value_loss()(x, data, seqs, toks)
    loss.backward()
    assert x.grad is not None
    return float(x.grad.square().sum().sqrt())


def term_scale(model: str, batch: BatchedDataDict, inputs: torch.Tensor) -> float:
    """A bound on N |c_t|, the size of one loss token's term times the token count."""
    if model == "policy":  # clipped ratio (<= 1.2) times |A|, plus the small KL penalty
        return 2 * float(batch["advantages"].abs().max())
    return 0.5 * float((inputs.abs() + batch["returns"].abs() + 0.2).square().max())


def norm_tol(grad_norm: float, n_tokens: int, params: int) -> float:
    """Gradient norm: coordinates reordered over N tokens, plus the norm kernel's own cascaded summation."""
    return f32_tol(grad_norm, n_tokens) + EPS_F32 * math.log2(params) * grad_norm


def compare(
    got: Outcome, want: Outcome, batch: BatchedDataDict, model: str, *, vocab: int, hidden: int
) -> dict[str, tuple[float, float]]:
    """Every compared quantity as (max |difference|, tolerance); the caller asserts difference <= tolerance."""
    out: dict[str, tuple[float, float]] = {}
    for name, ref in want.passes.items():
        if name in got.passes:
            n = vocab if name in ("logprobs", "reference") else hidden
            out[name] = (float((got.passes[name] - ref).abs().max()), f32_tol(float(ref.abs().max()), n))
    key = "logprobs" if model == "policy" else "values"
    input_tol, inputs = out[key][1], want.passes[key]
    n_tok = int(global_counts(batch, 1 if model == "policy" else 0)[1])
    params = sum(w.numel() for w in want.weights.values())
    grad_tol = f32_tol(MAX_GRAD_NORM, n_tok)
    sens, scale = sensitivity(model, batch, inputs), term_scale(model, batch, inputs)
    for call, (a, b) in enumerate(zip(got.results, want.results)):
        gn = float(b["grad_norm"])
        w_tol = trained_weight_tol(want.weights, grad_tol=grad_tol, lr=LR, steps=call, eps=ADAM_EPS) if call else 0.0
        loss = float(b["loss"].abs().max())  # the result's own rounding, half an ulp on each side
        tol = K * input_tol * sens + f32_tol(scale / n_tok, n_tok) + K * w_tol * gn + EPS_F32 * loss
        out[f"loss[{call}]"] = (float((a["loss"] - b["loss"]).abs().max()), tol)
        out[f"mb_loss_sum[{call}]"] = (abs(sum(a["all_mb_metrics"]["loss"]) - sum(b["all_mb_metrics"]["loss"])), tol)
        out[f"grad_norm[{call}]"] = (abs(float(a["grad_norm"]) - gn), norm_tol(gn, n_tok, params))
    weights = max(float((got.weights[k] - w).abs().max()) for k, w in want.weights.items())
    out["weights"] = (weights, trained_weight_tol(want.weights, grad_tol=grad_tol, lr=LR, steps=CALLS, eps=ADAM_EPS))
    return out

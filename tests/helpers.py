"""Helpers shared by the tests (`from tests.helpers import ...`): float32 tolerances derived from rounding error,
training batches, run directories."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.generation.interfaces import GenerationInterface

#: float32 machine epsilon (2**-23; twice the unit roundoff u = 2**-24).
EPS_F32 = 2.0**-23
#: Rounding errors of a sum, modelled as independent and mean-zero, exceed K * sqrt(n) * eps * sum|terms| (that is
#: lambda = 2K = 6 in Higham & Mary's probabilistic bound, SIAM J. Sci. Comput. 2019) with probability below about
#: 2n * exp(-lambda**2 / 2) = 3e-8 n.
K = 3.0


def f32_tol(scale: float, n: int) -> float:
    """How far a float32 sum of `n` terms, each at most `scale` in magnitude, can move when it is computed in another
    order (other kernels, another split over micro-batches or ranks): K * eps_f32 * sqrt(n) * scale."""
    return K * EPS_F32 * math.sqrt(n) * scale


def adam_rho(steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """Largest |m_hat| / sqrt(v_hat) of Adam's bias-corrected moments within `steps` steps (Cauchy-Schwarz over the
    steps' weights a_t in m_hat and b_t in v_hat: sqrt(sum a_t**2 / b_t); 1.0 at 1 step, 1.016 at 6)."""
    b1, b2 = betas
    a = [(1 - b1) * b1**k / (1 - b1**steps) for k in range(steps)]
    b = [(1 - b2) * b2**k / (1 - b2**steps) for k in range(steps)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def adamw_weight_tol(
    grad_tol: float,
    *,
    lr: float,
    steps: int,
    eps: float,
    weight_scale: float,
    betas: tuple[float, float] = (0.9, 0.999),
) -> float:
    """Bound on the difference of weights after `steps` AdamW steps (no weight decay) whose gradients differ by at
    most `grad_tol` per coordinate.

    The update m_hat / (sqrt(v_hat) + eps) moves by at most (1 + rho) * grad_tol / eps: m_hat (a weighted mean of the
    gradients) and sqrt(v_hat) (a weighted root-mean-square) each move by at most grad_tol, and |m_hat| <= rho *
    sqrt(v_hat) (`adam_rho`). Each step moves a weight by lr times that, plus the rounding of the step itself (half
    an ulp of |w| <= `weight_scale` on each side). At AdamW's default eps = 1e-8 the bound exceeds lr: a coordinate
    whose gradient is ~1e-8 (the tiny test model's k_proj.bias has several) takes a step of up to lr whose size
    and sign rounding decides. A test comparing weights needs eps near the gradients' own scale.
    """
    per_step = lr * (1 + adam_rho(steps, betas)) * grad_tol / eps + EPS_F32 * weight_scale
    return steps * per_step


def grad_norm_tol(grad_norm: float, n_params: int, n_tokens: int) -> float:
    """The gradient norm sums the squares of `n_params` coordinates, each a mean over `n_tokens` tokens: a relative
    error of the coordinates (f32_tol over the tokens) moves it by the same relative amount, the sum of squares by
    f32_tol over the parameters."""
    return f32_tol(grad_norm, n_params) + f32_tol(grad_norm, n_tokens)


def trained_weight_tol(
    weights: dict[str, torch.Tensor],
    *,
    grad_tol: float,
    lr: float,
    steps: int,
    eps: float,
    betas: tuple[float, float] = (0.9, 0.999),
) -> float:
    """`adamw_weight_tol` with the largest |w| of `weights` as the weight scale."""
    scale = max(float(w.abs().max()) for w in weights.values())
    return adamw_weight_tol(grad_tol, lr=lr, steps=steps, eps=eps, weight_scale=scale, betas=betas)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def ragged_batch(
    vocab: int,
    seed: int,
    lengths: torch.Tensor,
    sample_mask: torch.Tensor,
    *,
    seq_len: int,
    returns: bool = False,
    prompt_len: int = 3,
    advantages: bool = True,
) -> BatchedDataDict:
    """A right-padded policy-training batch of random tokens: the first `prompt_len` positions are a "prompt" the
    loss ignores, one advantage per row (left out with `advantages=False`) and per-token `returns` for a critic when
    asked, drawn from `seed` in that order."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    ids = torch.randint(2, vocab, (rows, seq_len), generator=g)  # [B, S]
    real = torch.arange(seq_len)[None, :] < lengths[:, None]  # [B, S]
    token_mask = real.float()
    token_mask[:, :prompt_len] = 0.0
    batch = BatchedDataDict(
        input_ids=ids.masked_fill(~real, 0),
        input_lengths=lengths.clone(),
        token_mask=token_mask,
        sample_mask=sample_mask.clone(),
    )
    if advantages:
        batch["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, seq_len).clone()  # [B, S]
    if returns:
        batch["returns"] = torch.randn(rows, seq_len, generator=g)
    return batch


def rollout_like_batch(
    lengths: list[int], vocab: int, pad_id: int, *, mult: int, seed: int = 0, logprob_scale: float = 1.0
) -> BatchedDataDict:
    """What the legacy rollout flatten produces: random tokens right-padded with `pad_id` to round_up(max, `mult`),
    the first third of each row a prompt masked from the loss, generation log-probs in (-`logprob_scale`, 0] on the
    loss tokens, every row i with i % 5 == 3 masked out; drawn from `seed`."""
    from relayrl.data_plane.schema import round_up

    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), round_up(max(lengths), mult)
    lens = torch.tensor(lengths)
    real = torch.arange(width)[None, :] < lens[:, None]  # [B, S]
    prompt = torch.arange(width)[None, :] < (lens // 3)[:, None]  # [B, S]
    token_mask = (real & ~prompt).long()  # [B, S]
    ids = torch.randint(3, vocab, (n, width), generator=g)  # [B, S], drawn before the log-probs
    logprobs = -torch.rand(n, width, generator=g) * logprob_scale  # [B, S]
    return BatchedDataDict(
        input_ids=ids.masked_fill(~real, pad_id),  # [B, S]
        input_lengths=lens,  # [B]
        generation_logprobs=logprobs.masked_fill(token_mask == 0, 0.0),  # [B, S]
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0 if i % 5 != 3 else 0.0 for i in range(n)]),  # [B]
    )


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metrics_by_step(
    run_dir: Path,
    prefixes: tuple[str, ...] = ("train/", "critic/", "validation/"),
    skip: tuple[str, ...] = ("per_sec",),
) -> dict[int, dict]:
    """The last logged value of every metric under `prefixes` per step (a killed and resumed run may log a step twice),
    leaving out names that contain any of `skip` (rates per second depend on the machine)."""
    out: dict[int, dict] = {}
    for row in metrics_rows(run_dir):
        keep = {k: v for k, v in row.items() if k.startswith(prefixes) and not any(x in k for x in skip)}
        if keep:
            out.setdefault(int(row["step"]), {}).update(keep)
    return out


def assert_breakdown_adds_up(run_dir: Path, tol: float = 0.02, timed: tuple[str, ...] = ()) -> int:
    """On every step logged in `run_dir`, the top-level phases (`STEP_PHASES`) sum to `timing/train/total_step_time`
    within `tol` of it, the logged `unaccounted` is that remainder, and every other label is a sub-phase (a `/` path
    timed inside a phase), so no top-level time goes unnamed; each phase of `timed` took time on every step.
    Returns the number of steps checked."""
    from relayrl.utils.timer import STEP_PHASES, TOTAL, UNACCOUNTED

    checked = 0
    for row in metrics_rows(run_dir):
        timing = {k.removeprefix("timing/train/"): v for k, v in row.items() if k.startswith("timing/train/")}
        if TOTAL not in timing:
            continue
        total = timing[TOTAL]
        covered = sum(v for k, v in timing.items() if k in STEP_PHASES)
        unnamed = [k for k in timing if k not in (*STEP_PHASES, TOTAL, UNACCOUNTED) and "/" not in k]
        assert not unnamed, f"step {row['step']}: top-level timers missing from STEP_PHASES: {unnamed}"
        assert abs(total - covered) <= tol * total, (
            f"step {row['step']}: phases sum to {covered:.4f} s of total_step_time {total:.4f} s "
            f"({100 * (total - covered) / total:+.1f}%): { {k: round(v, 4) for k, v in timing.items()} }"
        )
        assert math.isclose(timing[UNACCOUNTED], total - covered, rel_tol=1e-6, abs_tol=1e-9)
        assert all(timing.get(p, 0.0) > 0.0 for p in timed), f"step {row['step']}: {timed} not all timed: {timing}"
        checked += 1
    assert checked > 0, f"no step timings in {run_dir / 'metrics.jsonl'}"
    return checked


def tiny_grpo_overrides(model_dir: Path, *extra: str) -> list[str]:
    """Dotted overrides of the small GRPO run the integration tests share: the random 2-layer test model, 4 prompts x
    4 generations of up to 8 new tokens, two micro-batches of 8, validation on 8 problems every 2 steps. `extra`
    comes last, so it overrides any of these."""
    return [
        f"policy.model_name={model_dir}",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.generation.max_new_tokens=8",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.val_period=2",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        "logger.progress_bar=false",
        *extra,
    ]


def tiny_ppo_overrides(model_dir: Path, *extra: str) -> list[str]:
    """Dotted overrides of the small PPO run the integration tests share: policy and critic from the random test
    model, 4 prompts x 2 generations, 2 PPO epochs, the actor trained from step 1, validation on 8 problems every 2
    steps. `extra` comes last, so it overrides any of these."""
    return [
        "algorithm=ppo",
        f"policy.model_name={model_dir}",
        f"value.model_name={model_dir}",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=4",
        "value.train_global_batch_size=8",
        "value.train_micro_batch_size=4",
        "policy.generation.max_new_tokens=8",
        "policy.optimizer.kwargs.lr=1e-3",
        "loss_fn.reference_policy_kl_penalty=0.01",
        "ppo.num_prompts_per_step=4",
        "ppo.num_generations_per_prompt=2",
        "ppo.ppo_epochs=2",
        "ppo.policy_training_start_step=1",
        "ppo.val_period=2",
        "ppo.max_val_samples=8",
        "ppo.val_batch_size=8",
        "logger.progress_bar=false",
        "logger.tensorboard_enabled=false",
        *extra,
    ]


#: What a run that is compared to another one, or resumed, adds: deterministic kernels, one thread, a real lr.
EXACT_RUN = (
    "policy.optimizer.kwargs.lr=1e-3",
    "logger.tensorboard_enabled=false",
    "cluster.deterministic=true",
    "cluster.torch_num_threads=1",
)

#: An exact 2-prompt run with no validation and a kept checkpoint after every step: what the fault probes damage.
CHECKPOINT_EVERY_STEP = (
    *EXACT_RUN,
    "grpo.num_prompts_per_step=2",
    "policy.train_global_batch_size=8",
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "checkpointing.save_period=1",
    "checkpointing.keep_top_k=null",
)


#: Runs `python ARGV...` (`-m module args` or `-c code args`) with `CheckpointManager.finalize_checkpoint` patched to
#: SIGKILL the process the moment the checkpoint named by the first argument is published.
_KILL_AT_CHECKPOINT = """
import os, runpy, signal, sys
from pathlib import Path
from relayrl.utils import checkpoint
target, argv = Path(sys.argv[1]).resolve(), sys.argv[2:]
finalize = checkpoint.CheckpointManager.finalize_checkpoint
def finalize_then_die(self, tmp_path):
    out = finalize(self, tmp_path)
    if Path(out).resolve() == target:
        os.kill(os.getpid(), signal.SIGKILL)
    return out
checkpoint.CheckpointManager.finalize_checkpoint = finalize_then_die
if argv[0] == "-m":
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = ["-c", *argv[2:]]
    exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
"""


def sigkill_after_checkpoint(argv: list[str], checkpoint: Path, timeout_s: float = 300) -> None:
    """Run `python argv...` and SIGKILL it the moment `checkpoint` (a step_N directory) is published.

    The process kills itself from inside `finalize_checkpoint`, so the kill lands at the same point of every run: a
    poll from outside could miss a checkpoint that a fast run publishes and prunes between two looks."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_AT_CHECKPOINT, str(checkpoint), *argv],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"no checkpoint {checkpoint.name} within {timeout_s:.0f} s") from None
    assert proc.returncode == -signal.SIGKILL, (
        f"training process ended (exit {proc.returncode}) without publishing {checkpoint.name}:\n{err[-2000:]}"
    )
    assert checkpoint.is_dir()


#: The random test model behind tests/conftest.py's `tiny_model_dir`: 2 layers, hidden 64, 4 heads, 2 KV heads.
TEST_MODEL: dict[str, int] = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0
)


def build_test_model(tokenizer: Any) -> torch.nn.Module:
    """A fresh copy of the random test model (the same weights every call) for `tokenizer`'s vocabulary."""
    from relayrl.models.tiny import build_tiny_qwen2

    return build_tiny_qwen2(len(tokenizer), **TEST_MODEL)


def build_reward_classifier(
    vocab_size: int,
    *,
    seed: int,
    score_std: float | None = None,
    num_labels: int = 1,
    pad_token_id: int | None = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
) -> torch.nn.Module:
    """A random Qwen2 sequence classifier (4 heads, 2 KV heads) drawn from `seed`; `score_std` redraws the score
    head's weights with that spread (wider scores)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=intermediate_size,
        num_labels=num_labels,
        pad_token_id=pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    if score_std is not None:
        with torch.no_grad():
            model.score.weight.normal_(0.0, score_std)
    return model


def save_test_reward_model(path: Path, tokenizer: Any, *, seed: int, **sizes: Any) -> Path:
    """A random one-label `build_reward_classifier` (pad id 0; `sizes`: score_std and the model sizes) for
    `tokenizer`, saved with it as a Hugging Face directory."""
    build_reward_classifier(len(tokenizer), seed=seed, **sizes).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def small_policy_config(model_dir: Path, config_cls: Any = None, **keys: Any) -> Any:
    """A PolicyConfig (or `config_cls`: ValueConfig takes the same keys) for `model_dir` with global batches of 4 in
    micro-batches of 2 and lr 1e-2; `keys` replace or add top-level fields (dicts for nested blocks)."""
    from relayrl.config import PolicyConfig

    base: dict[str, Any] = dict(
        model_name=str(model_dir),
        train_global_batch_size=4,
        train_micro_batch_size=2,
        optimizer={"kwargs": {"lr": 1e-2}},
    )
    return (config_cls or PolicyConfig).model_validate({**base, **keys})


def with_rl_keys(policy: Any, data: BatchedDataDict) -> BatchedDataDict:
    """A copy of `data` with the keys ClippedPGLossFn reads, computed by `policy` itself (sharded across its ranks):
    prev and reference logprobs, and generation logprobs with a little off-policy noise."""
    lp = policy.get_logprobs(data)["logprobs"]
    data = data.copy()
    data["prev_logprobs"] = lp
    data["generation_logprobs"] = lp + 0.01 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    return data


def train_on_policy(policy: Any, data: BatchedDataDict) -> None:
    """One train() call on `data` as if `policy` had just sampled it: generation and reference logprobs equal the
    policy's own, no KL penalty."""
    from relayrl.algorithms.loss_functions import ClippedPGLossFn
    from relayrl.config import ClippedPGLossConfig

    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    data["generation_logprobs"] = data["prev_logprobs"].clone()
    data["reference_policy_logprobs"] = data["prev_logprobs"].clone()
    policy.train(data, ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)))


def scripted_generation_output(
    data: BatchedDataDict,
    replies: list[list[int]],
    truncated: list[bool],
    *,
    pad_id: int,
    logprobs: Callable[[int], torch.Tensor],
) -> BatchedDataDict:
    """What a generation backend returns when row i of `data` is answered with the tokens `replies[i]`: prompt and
    reply right-padded with `pad_id`, `logprobs(len(reply))` at the reply positions (zeros elsewhere)."""
    ids, lengths = data["input_ids"], data["input_lengths"]  # [B, S], [B]
    width = ids.shape[1] + max(len(r) for r in replies)
    out = torch.full((len(replies), width), pad_id, dtype=torch.long)  # [B, S + G]
    lps = torch.zeros(out.shape)  # [B, S + G]
    for i, (reply, n) in enumerate(zip(replies, lengths.tolist())):
        out[i, :n] = ids[i, :n]
        out[i, n : n + len(reply)] = torch.tensor(reply)
        lps[i, n : n + len(reply)] = logprobs(len(reply))
    gen_lengths = torch.tensor([len(r) for r in replies])
    return BatchedDataDict(
        output_ids=out,
        logprobs=lps,
        generation_lengths=gen_lengths,
        unpadded_sequence_lengths=lengths + gen_lengths,
        truncated=torch.tensor(truncated),
    )


class ScriptedGenerationBase(GenerationInterface):
    """A generation backend for tests: subclasses write `generate`; the lifecycle calls succeed and do nothing."""

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def shutdown(self) -> bool:
        return True


class RunsCode:
    """Unpickling this runs a shell command that creates `marker`: what a crafted checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def tight_deadlines(monkeypatch: Any, **fields: float) -> None:
    """Configure `cluster.*` deadlines (e.g. `call_timeout_s=0.3`) through the config for one test; the process's
    previous deadlines come back afterwards (they travel in the environment, which `monkeypatch` restores)."""
    from relayrl.config import ClusterConfig
    from relayrl.utils import deadlines

    for kind in ("start", "call", "wait", "collective"):
        # setenv, not delenv: delenv of an unset variable records nothing, so what `configure` writes next would
        # outlive the test (a 0.2 s collective deadline leaked into later refit tests of the same worker process)
        monkeypatch.setenv(f"RELAYRL_{kind.upper()}_TIMEOUT_S", "")  # empty: the schema's default
    deadlines.configure(ClusterConfig(**fields))


#: A tiny GRPO run with one training rank on each of two Ray nodes, a checkpoint every step: what the simulated
#: multi-node tests train (test_ray_multinode.py); steps are the caller's.
TWO_NODE_GRPO = (
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "policy.generation.max_new_tokens=12",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "checkpointing.save_period=1",
    "logger.progress_bar=false",
    "logger.tensorboard_enabled=false",
    "cluster.executor=ray",
    "cluster.num_nodes=2",
    "cluster.workers_per_node=1",
)

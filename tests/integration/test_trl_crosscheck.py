"""relayrl's GRPO loss and advantages against TRL's, on identical batches (issue 18, point 5; `bench` extra).

One real `trl.GRPOTrainer` step on the tiny test model produces a batch: prompts, sampled completions, their masks,
the rewards its reward function returned, TRL's advantages, reference log-probs. On that batch:

- TRL's advantages (`scale_rewards="group"`) equal relayrl's `GRPOAdvantageEstimator` with
  `grpo.normalize_rewards_epsilon=1e-4` (TRL's constant), and `scale_rewards="none"` (Dr. GRPO) equals relayrl's
  `normalize_rewards=false` on the same rewards;
- for `loss_type` grpo, dapo and dr_grpo, with and without the KL term (beta) and with asymmetric clipping
  (epsilon / epsilon_high), TRL's `_compute_loss` and relayrl's `ClippedPGLossFn` under the mapped config
  (docs/trl_mapping.md) give the same loss and the same gradient on the model's weights, to 1e-6.

Old-policy log-probs are the model's own shifted by seeded noise, so the clipping region is exercised on both sides.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from relayrl.algorithms.advantages import GRPOAdvantageEstimator  # noqa: E402
from relayrl.algorithms.loss_functions import ClippedPGLossFn  # noqa: E402
from relayrl.config import ClippedPGLossConfig  # noqa: E402

G, PROMPTS, MAX_NEW = 4, 4, 12
BETA, EPS_LOW, EPS_HIGH = 0.04, 0.2, 0.28
TOL = 1e-6


def _reward(completions: list[str], **_: Any) -> list[float]:
    """A deterministic reward with spread inside every group: a digest of the completion text in {0, 0.5, 1}."""
    return [(zlib.crc32(c.encode()) % 3) / 2 for c in completions]


def _trl_step(model_dir: Any, out_dir: Any, scale_rewards: str) -> dict[str, Any]:
    """One GRPOTrainer step; the inputs its loss saw, with the trainer itself."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = ["12+34=", "56-7=", "40+41=", "99-18="]
    rows = [
        {
            "prompt": tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
        }
        for p in problems
    ]
    args = trl.GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        max_steps=1,
        per_device_train_batch_size=PROMPTS * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=MAX_NEW,
        beta=BETA,
        loss_type="grpo",
        scale_rewards=scale_rewards,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[_reward],
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    seen: dict[str, Any] = {}
    compute = trainer._compute_loss

    def capture(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        seen.setdefault("inputs", {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return compute(model, inputs)

    trainer._compute_loss = capture
    trainer.train()
    inputs = seen["inputs"]
    prompts = tokenizer.batch_decode(inputs["prompt_ids"], skip_special_tokens=False)
    completions = tokenizer.batch_decode(inputs["completion_ids"], skip_special_tokens=True)
    return {"trainer": trainer, "inputs": inputs, "rewards": torch.tensor(_reward(completions)), "prompts": prompts}


@pytest.fixture(scope="module")
def trl_step(tiny_model_dir, tmp_path_factory) -> dict[str, Any]:
    return _trl_step(tiny_model_dir, tmp_path_factory.mktemp("trl"), "group")


def _group_means(prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
    """[B] mean reward of each row's prompt group (TRL shuffles a generation batch's rows before the loss sees
    them, so groups are found by prompt, as relayrl finds them)."""
    return torch.stack([rewards[[q == p for q in prompts]].mean() for p in prompts])


def test_group_scaled_advantages_match(trl_step):
    inputs, rewards = trl_step["inputs"], trl_step["rewards"]
    prompts = trl_step["prompts"]
    assert sorted(prompts.count(p) for p in set(prompts)) == [G] * PROMPTS  # G rows of each prompt
    estimator = GRPOAdvantageEstimator(True, False, epsilon=1e-4)
    ours = estimator.compute_advantage(inputs["prompt_ids"], rewards, torch.ones(len(rewards), 1))  # [B, 1]
    assert float((inputs["advantages"] != 0).sum()) >= 2 * G  # groups with spread: the check has substance
    torch.testing.assert_close(ours[:, 0], inputs["advantages"].float(), atol=TOL, rtol=0)


def test_unscaled_advantages_match_dr_grpo(tiny_model_dir, tmp_path):
    """Dr. GRPO's `scale_rewards="none"` against relayrl's normalize_rewards=false."""
    step = _trl_step(tiny_model_dir, tmp_path, "none")
    rewards, inputs = step["rewards"], step["inputs"]
    assert torch.equal(inputs["advantages"].float(), rewards - _group_means(step["prompts"], rewards))  # centred only
    ours = GRPOAdvantageEstimator(False, False).compute_advantage(
        inputs["prompt_ids"], rewards, torch.ones(len(rewards), 1)
    )
    torch.testing.assert_close(ours[:, 0], inputs["advantages"].float(), atol=TOL, rtol=0)


def _relayrl_loss(logps, inputs, old, ref, loss_type: str, beta: float, kl_is: bool) -> torch.Tensor:
    """relayrl's loss on TRL's completion-aligned tensors: a leading dummy column makes relayrl's `[:, 1:]` slice
    line up with TRL's completion positions."""
    mask = inputs["completion_mask"].float()  # [B, T]
    b, t = mask.shape

    def shift(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros(b, 1, dtype=x.dtype), x], dim=1)  # [B, T + 1]

    cfg = ClippedPGLossConfig(
        reference_policy_kl_penalty=beta,
        reference_policy_kl_type="k3",
        kl_input_clamp_value=None,
        kl_output_clamp_value=None,
        ratio_clip_min=EPS_LOW,
        ratio_clip_max=EPS_HIGH,
        token_level_loss=loss_type != "grpo",
        use_on_policy_kl_approximation=kl_is,
    )
    data = {
        "token_mask": shift(mask),
        "sample_mask": torch.ones(b),
        "advantages": shift(inputs["advantages"].float().unsqueeze(-1).expand(b, t)),
        "generation_logprobs": shift(old),
        "prev_logprobs": shift(old),
        "reference_policy_logprobs": shift(ref),
    }
    tokens = {"grpo": mask.sum(), "dapo": mask.sum(), "dr_grpo": torch.tensor(float(b * MAX_NEW))}[loss_type]
    loss, _ = ClippedPGLossFn(cfg)(logps, data, torch.tensor(float(b)), tokens)
    return loss


@pytest.mark.parametrize(("beta", "kl_is"), [(0.0, True), (BETA, True), (BETA, False)], ids=["no_kl", "kl", "kl_plain"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_loss_and_gradient_match(trl_step, loss_type, beta, kl_is):
    """`kl_is` maps TRL's use_bias_correction_kl to relayrl's use_on_policy_kl_approximation. Without it the loss
    values still agree but the KL gradients do not: relayrl's unweighted KL keeps the score-function term
    (docs/trl_mapping.md), so only the loss is compared there."""
    trainer, captured = trl_step["trainer"], trl_step["inputs"]
    model = trainer.model
    model.train()
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.epsilon_low, trainer.epsilon_high = EPS_LOW, EPS_HIGH
    trainer.current_gradient_accumulation_steps = 1
    trainer.args.use_bias_correction_kl = kl_is
    ids = torch.cat([captured["prompt_ids"], captured["completion_ids"]], dim=1)
    attention = torch.cat([captured["prompt_mask"], captured["completion_mask"]], dim=1)
    t = captured["completion_ids"].shape[1]
    with torch.no_grad():
        base = trainer._get_per_token_logps_and_entropies(model, ids, attention, t)[0]  # [B, T]
    gen = torch.Generator().manual_seed(1)
    old = base + 0.3 * torch.randn(base.shape, generator=gen)  # ratios well outside 1 +- epsilon
    ref = base + 0.2 * torch.randn(base.shape, generator=gen)
    inputs = {**captured, "old_per_token_logps": old, "ref_per_token_logps": ref}

    model.zero_grad()
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    grad_theirs = [p.grad.clone() for p in model.parameters() if p.grad is not None]

    model.zero_grad()
    logps = trainer._get_per_token_logps_and_entropies(model, ids, attention, t)[0]  # [B, T], with grad
    ours = _relayrl_loss(logps, captured, old, ref, loss_type, beta, kl_is)
    ours.backward()
    grad_ours = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()

    clipped = ((logps.detach() - old).exp() - 1).abs() > EPS_LOW
    assert bool((clipped & captured["completion_mask"].bool()).any())  # the clip region is exercised
    assert abs(float(theirs) - float(ours)) <= TOL, (float(theirs), float(ours))
    assert len(grad_theirs) == len(grad_ours) > 0
    if not kl_is:
        return
    worst = max(float((a - b).abs().max()) for a, b in zip(grad_theirs, grad_ours))
    assert worst <= TOL, f"largest gradient difference {worst:.3g}"

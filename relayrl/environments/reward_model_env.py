"""Reward-model environment: a learned reward in place of a verifier.

Each conversation is rendered to text (by default the tokenizer's chat template over role and content, no
generation prompt), tokenized without extra special tokens, right-padded and scored by a `RewardModelPolicy`; the
score is the reward and every row terminates. The renderer can be replaced so that scoring sees exactly the text
the reward model was trained on (relayrl's prompt datasets store the already-rendered prompt as the user message's
content, so the default template wraps it a second time; a reward model trained through the same `render` agrees).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relayrl.config import RewardModelEnvConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog
from relayrl.models.policy.reward_model import RewardModelPolicy

Renderer = Callable[[MessageLog], str]
_NORMALIZE_EPS = 1e-6


def chat_template_renderer(tokenizer: Any) -> Renderer:
    """The default renderer: `tokenizer.apply_chat_template` over role/content, as a string."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("reward-model environment: the tokenizer has no chat template; pass render=...")

    def render(messages: MessageLog) -> str:
        conversation = [{"role": m["role"], "content": str(m.get("content") or "")} for m in messages]
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)

    return render


def concatenation_renderer(messages: MessageLog) -> str:
    """Contents joined as they are: for logs whose prompt message already holds the rendered chat prompt."""
    return "".join(str(m.get("content") or "") for m in messages)


class RewardModelEnvironment(EnvironmentInterface):
    """Single-turn environment whose reward is a reward model's score of the whole conversation."""

    def __init__(
        self,
        reward_model: RewardModelPolicy,
        tokenizer: Any,
        *,
        normalize: bool = False,
        render: Renderer | None = None,
    ) -> None:
        if not isinstance(reward_model, RewardModelPolicy):
            raise TypeError(f"reward_model must be a RewardModelPolicy, got {type(reward_model).__name__}")
        if tokenizer is None:
            raise ValueError("reward-model environment needs the reward model's tokenizer")
        self.reward_model = reward_model
        self.tokenizer = tokenizer
        self.normalize = normalize
        self.render = render if render is not None else chat_template_renderer(tokenizer)
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: RewardModelEnvConfig, render: Renderer | None = None) -> RewardModelEnvironment:
        """Build the classifier and its tokenizer from `model_dir`; `render` overrides `cfg.render`."""
        rm = RewardModelPolicy(cfg.model_dir, device=cfg.device, micro_batch_size=cfg.micro_batch_size)
        if rm.tokenizer is None:
            raise ValueError(f"reward model directory {cfg.model_dir} holds no tokenizer (tokenizer_config.json)")
        if render is None and cfg.render == "concatenation":
            render = concatenation_renderer
        return cls(rm, rm.tokenizer, normalize=cfg.normalize, render=render)

    def tokenize(self, message_log_batch: list[MessageLog]) -> BatchedDataDict:
        """Rendered and tokenized conversations, right-padded: {input_ids [B, S], input_lengths [B]}."""
        texts = [self.render(log) for log in message_log_batch]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"reward-model environment row {i}: the rendered conversation has no tokens")
        lengths = torch.tensor([len(r) for r in ids], dtype=torch.long)  # [B]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(ids), int(lengths.max()) if ids else 0), pad, dtype=torch.long)  # [B, S]
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return BatchedDataDict(input_ids=input_ids, input_lengths=lengths)

    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        """Score every row; observation `Reward: <reward>`, every row terminated, metadata passed through."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(
                f"reward-model env got {len(message_log_batch)} message logs but {len(metadata)} metadata rows"
            )
        n = len(message_log_batch)
        if n:
            scores = self.reward_model.score(self.tokenize(message_log_batch))["scores"].float()  # [B]
        else:
            scores = torch.zeros(0)
        rewards = scores
        if self.normalize and n:
            rewards = (scores - scores.mean()) / (scores.std(unbiased=False) + _NORMALIZE_EPS)  # [B]
        self.last_metrics = {
            "reward_model_score_mean": scores.mean().item() if n else 0.0,
            "reward_model_score_std": scores.std(unbiased=False).item() if n else 0.0,
        }
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Reward: {float(r):.3f}"} for r in rewards],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=rewards.to(torch.float32),  # [B]
            terminateds=torch.ones(n, dtype=torch.bool),  # [B]
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """Mean reward over the batch (rows that did not end properly count as 0, as in the math environment)."""
        rewards = batch["rewards"] if "rewards" in batch else batch["total_reward"]
        rewards = torch.as_tensor(rewards, dtype=torch.float32)  # [B]
        if "truncated" in batch:
            rewards = rewards * (~torch.as_tensor(batch["truncated"], dtype=torch.bool)).float()
        n = rewards.shape[0]
        return batch, {"reward_mean": rewards.mean().item() if n else 0.0, "num_problems_in_batch": n}

    def shutdown(self) -> None:
        self.reward_model.shutdown()

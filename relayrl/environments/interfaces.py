"""Environment contract: score a batch of conversations and say what the world answers back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

# A message log is a list of {"role", "content", ...} dicts; the rollout adds "token_ids" and, for generated
# assistant turns, "generation_logprobs".
Message = dict[str, Any]
MessageLog = list[Message]


class EnvironmentReturn(NamedTuple):
    """What one `step` returns, one entry per row of the batch."""

    observations: list[Message]  # appended to each conversation, e.g. {"role": "environment", "content": ...}
    metadata: list[dict[str, Any] | None]  # per-row state carried to the next turn
    next_stop_strings: list[list[str] | None]  # per-row stop strings for the next turn
    rewards: torch.Tensor  # [B] float32
    terminateds: torch.Tensor  # [B] bool, the episode ended
    answers: list[str | None] | None = None  # extracted answers, when the environment parses them
    # Per-row flags for the latest assistant message (e.g. {"is_invalid_tool_call": True}); trainers turn these into
    # message-level advantage penalties (`reward_penalties`).
    message_flags: list[dict[str, bool]] | None = None


class EnvironmentInterface(ABC):
    """Scores conversations. Stateless across calls: per-row state travels in `metadata`."""

    @abstractmethod
    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        """Score one turn for every row; messages carry only `role` and `content`."""

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """Optional whole-batch metrics (accuracy, pass@k, ...) after a rollout."""
        return batch, {}

    def rollout_metrics(self) -> dict[str, float]:
        """Metrics gathered over the `step` calls since the last call (then reset), added to the rollout's metrics
        (e.g. `reward/<name>` per reward function). Most environments report none."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional hook, most environments hold nothing
        """Release worker pools, if any."""

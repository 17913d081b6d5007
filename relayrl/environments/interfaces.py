"""Environment contract: score a batch of conversations and say what the world answers back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

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

    def fork(self, fork: Callable[[EnvironmentInterface], EnvironmentInterface]) -> EnvironmentInterface:
        """This environment for rollouts that run on another thread at the same time (asynchronous GRPO's producer
        beside validation): one that keeps state between calls (episodes, counters reported by `rollout_metrics`)
        returns a fresh copy, forking the environments it holds with `fork`; one that keeps none returns itself."""
        return self


class EpisodeStart(NamedTuple):
    """How one rollout of a per-rollout environment begins: the conversation the rollout renders with the chat
    template (with `tools`) into the first prompt, and the row's metadata from then on."""

    messages: list[Message]  # {"role", "content"} dicts, rendered with add_generation_prompt
    tools: list[dict[str, Any]] | None  # JSON schemas handed to the chat template as `tools=`
    template_kwargs: dict[str, Any]  # further chat-template keyword arguments (policy.tokenizer.chat_template_kwargs)
    metadata: dict[str, Any]  # replaces the row's metadata (e.g. the episode's id)


@runtime_checkable
class EpisodeEnvironment(Protocol):
    """What an environment adds to `EnvironmentInterface` to keep one object per rollout (TRL's
    `environment_factory`): the rollout starts every row's episode before the first turn and ends the episodes
    it stops itself (turn limit, sequence budget) after the last. Its observations may be chat messages
    (`{"role", "content", "chat": [messages]}`), which the rollout renders through the chat template, with the
    tool calls that produced them (`"calls": [{"name", "arguments", "status", "latency_s"}]`, recorded per turn)."""

    def start_episodes(self, metadata: list[dict[str, Any] | None]) -> list[EpisodeStart]:
        """Create and reset one environment per row; raises naming the class and dataset row when reset fails."""
        ...

    def end_episodes(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EpisodeEnd:
        """Score and release the episodes the rollout stopped before the environment ended them."""
        ...


class EpisodeEnd(NamedTuple):
    """The final rewards [B] and metadata of episodes the rollout stopped."""

    rewards: torch.Tensor  # [B] float32
    metadata: list[dict[str, Any] | None]

"""The rollout's side of per-rollout environments (`EpisodeEnvironment`): start every row's episode before the
first turn (the first prompt re-rendered with the tools and the text `reset` returned), render chat observations
as template continuations, and end the episodes the rollout stops itself.

Rows of batched `EnvironmentInterface`s are left exactly as they were: these helpers touch only rows whose
environment keeps episodes, so single-turn runs build the same tensors as before.
"""

from __future__ import annotations

from typing import Any

import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface, EpisodeEnvironment, Message
from relayrl.experience.chat_render import ChatRenderer

#: Per row of an episode environment: (tools, chat-template kwargs) its observations are rendered with.
ChatSettings = dict[int, tuple[list[dict[str, Any]] | None, dict[str, Any]]]


def episode_envs(task_to_env: dict[str, EnvironmentInterface]) -> dict[str, EpisodeEnvironment]:
    """The environments of `task_to_env` that keep one object per rollout."""
    return {task: env for task, env in task_to_env.items() if isinstance(env, EpisodeEnvironment)}


def rows_by_task(task_names: list[str], rows: list[int], tasks: set[str] | dict[str, Any]) -> dict[str, list[int]]:
    """`rows` grouped by task name, only tasks in `tasks`, in row order."""
    out: dict[str, list[int]] = {}
    for i in rows:
        if task_names[i] in tasks:
            out.setdefault(task_names[i], []).append(i)
    return out


def start_episodes(
    batch: BatchedDataDict,
    envs: dict[str, EpisodeEnvironment],
    renderer: ChatRenderer,
    max_seq_len: int,
) -> ChatSettings:
    """Reset one environment per row of an episode task and replace the row's prompt with the conversation it
    starts (rendered with the tools); `length` follows. Edits `batch` (its lists already copied) in place."""
    settings: ChatSettings = {}
    n = len(batch["message_log"])
    groups = rows_by_task(list(batch["task_name"]), list(range(n)), envs)
    if not groups:
        return settings
    if "length" in batch:
        batch["length"] = torch.as_tensor(batch["length"]).clone()  # [B]
    for task, rows in groups.items():
        starts = envs[task].start_episodes([batch["extra_env_info"][i] for i in rows])
        for i, start in zip(rows, starts, strict=True):
            text, ids = renderer.prompt(start.messages, start.tools, start.template_kwargs)
            if len(ids) >= max_seq_len:
                raise ValueError(
                    f"row {i} (task {task!r}): its first prompt with the tool schemas is {len(ids)} tokens, leaving "
                    f"no room under policy.max_total_sequence_length={max_seq_len}; raise it or shorten the prompt"
                )
            batch["message_log"][i] = [
                # `messages`: the conversation as the environment began it (the flight recorder keeps it)
                {"role": "user", "content": text, "token_ids": torch.tensor(ids), "messages": list(start.messages)}
            ]
            batch["extra_env_info"][i] = start.metadata
            if "length" in batch:
                batch["length"][i] = len(ids)
            settings[i] = (start.tools, start.template_kwargs)
    return settings


def observation_ids(
    renderer: ChatRenderer, settings: ChatSettings, row: int, reply_ids: torch.Tensor, obs: Message
) -> tuple[str, list[int]]:
    """(text, ids) of a chat observation (`obs["chat"]`, a list of messages) as fed after the row's reply."""
    tools, kwargs = settings.get(row, (None, {}))
    return renderer.observation(reply_ids.tolist(), list(obs["chat"]), tools, kwargs)


def end_episodes(
    batch: BatchedDataDict,
    envs: dict[str, EpisodeEnvironment],
    unfinished: list[int],
    total_reward: torch.Tensor,
) -> None:
    """Score the episodes the rollout stopped (`unfinished` rows: turn limit or sequence budget) and add their
    final rewards to `total_reward` [B]; their metadata is replaced by the environment's."""
    for task, rows in rows_by_task(list(batch["task_name"]), unfinished, envs).items():
        logs = [[{"role": m["role"], "content": m["content"]} for m in batch["message_log"][i]] for i in rows]
        end = envs[task].end_episodes(logs, [batch["extra_env_info"][i] for i in rows])
        total_reward[rows] += end.rewards.to(torch.float32)
        for i, meta in zip(rows, end.metadata, strict=True):
            batch["extra_env_info"][i] = meta


def check_chat_template(tokenizer: Any, tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]) -> None:
    """Render a prompt and a tool observation once, so a template that cannot serve an environment class is refused
    (`ChatTemplateError`, one line) before any model loads rather than at the first tool call."""
    renderer = ChatRenderer(tokenizer)
    renderer.prompt([{"role": "user", "content": "ping"}], tools, template_kwargs)
    renderer.observation([], [{"role": "tool", "name": "probe", "content": "pong"}], tools, template_kwargs)

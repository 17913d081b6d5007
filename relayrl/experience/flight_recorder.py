"""The rollout side of the flight recorder: the per-sample values only a finished rollout has (text, environment
reward and metadata, truncation, prompt group), kept by sample key until the step's file is written.

On the data plane the rollout actor holds these (they never cross the driver); at the end of a recorded step it
joins them with the step's columns read from the store and writes the file (`relayrl.data_plane.recorder`). The
legacy trainer, which holds its whole batch, builds the same rows from its message logs (`rollout_rows`).

Each row also keeps its conversation turn by turn (`turns`, JSON; `turn_records`): per message its role, token
span in the sample's sequence, text; an assistant turn's tool calls (name, arguments), a tool turn's results. The
calls' latencies are a column of their own (`tool_latency_s`), so that `turns` is the same in two runs of one seed.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.data_plane.recorder import RecordValue, read_store_columns, warm_up, write_step
from relayrl.environments.interfaces import MessageLog

#: Per-sample values a rollout knows, in file column order.
ROW_COLUMNS: tuple[str, ...] = (
    "prompt_group",
    "task_name",
    "prompt",
    "completion",
    "reward_env",
    "loss_multiplier",
    "truncated",
    "prompt_length",
    "response_token_length",
    "env_metadata",
    "turns",
    "tool_latency_s",
)
#: Columns a stash row of an older checkpoint lacks (added since), with the value it gets.
_LATER_COLUMNS = {"turns": "[]", "tool_latency_s": "[]"}


@dataclasses.dataclass
class RecordRequest:
    """What the trainer asks the row holder to record for a step (picklable: it crosses to a Ray actor).

    `fields` are read from the store; `driver_columns` are per-row values the driver computed (post-processed
    rewards, baseline, std); `info` is step-level (rollout metrics, weight version, trainer)."""

    step: int
    rollouts_dir: str
    keep_last: int
    fields: list[str]
    driver_columns: dict[str, Any]
    info: dict[str, Any]


def _text(msgs: MessageLog, roles: tuple[str, ...]) -> str:
    return "".join(m["content"] for m in msgs if m["role"] in roles)


def turn_records(msgs: MessageLog) -> tuple[list[dict[str, Any]], list[float]]:
    """The conversation of one rollout, a record per message, and its tool calls' latencies (seconds, in order).

    A record is `{"role", "start", "end", "content"}` (`[start, end)`: the message's tokens in the sample's
    sequence, which the recording may cut after the last trained token); an assistant turn whose calls ran adds
    `tool_calls` (`[{"name", "arguments"}]`) and its environment flags; the tool turn after it adds `results`
    (`[{"name", "content", "status"}]`, one per call, in order) and `messages` (what the chat template rendered)."""
    records: list[dict[str, Any]] = []
    latencies: list[float] = []
    at = 0
    for m in msgs:
        n = len(m["token_ids"])
        rec: dict[str, Any] = {"role": m["role"], "start": at, "end": at + n, "content": m["content"]}
        if m.get("flags"):
            rec["flags"] = {k: bool(v) for k, v in m["flags"].items()}
        chat = m.get("messages")
        if chat is not None:
            rec["messages"] = [{"role": c["role"], "content": c["content"], **_name(c)} for c in chat]
        calls = m.get("calls")
        if calls:
            if records and records[-1]["role"] == "assistant":
                records[-1]["tool_calls"] = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
            texts = [c["content"] for c in chat or [] if c.get("role") == "tool"]
            rec["results"] = [
                {"name": c["name"], "content": texts[k] if k < len(texts) else "", "status": c["status"]}
                for k, c in enumerate(calls)
            ]
            latencies += [float(c["latency_s"]) for c in calls]
        records.append(rec)
        at += n
    return records, latencies


def _name(message: dict[str, Any]) -> dict[str, Any]:
    return {"name": message["name"]} if message.get("name") else {}


def rollout_rows(
    message_logs: Sequence[MessageLog],
    env_reward: torch.Tensor,
    loss_multiplier: torch.Tensor,
    truncated: torch.Tensor,
    prompt_lengths: torch.Tensor,
    prompt_group: torch.Tensor,
    task_names: Sequence[str] | None,
    env_metadata: Sequence[Any] | None,
) -> dict[str, list[Any]]:
    """The `ROW_COLUMNS` of a finished rollout: one list entry per row ([B] tensors in, Python values out)."""
    n = len(message_logs)
    meta = list(env_metadata) if env_metadata is not None else [None] * n
    turns = [turn_records(m) for m in message_logs]
    return {
        "prompt_group": prompt_group.tolist(),
        "task_name": list(task_names) if task_names is not None else [""] * n,
        "prompt": [_text(m, ("system", "user")) for m in message_logs],
        "completion": [_text(m, ("assistant",)) for m in message_logs],
        "reward_env": env_reward.float().tolist(),
        "loss_multiplier": loss_multiplier.float().tolist(),
        "truncated": truncated.bool().tolist(),
        "prompt_length": prompt_lengths.long().tolist(),
        "response_token_length": [
            next((len(m["token_ids"]) for m in msgs if m["role"] == "assistant"), 0) for msgs in message_logs
        ],
        "env_metadata": [json.dumps(x, default=str, sort_keys=True) for x in meta],
        "turns": [json.dumps(records, default=str) for records, _ in turns],
        "tool_latency_s": [json.dumps(latencies) for _, latencies in turns],
    }


class RolloutStash:
    """`ROW_COLUMNS` by sample key, per partition, until the step's file is written.

    The sync trainers roll every step into one partition, which a step's first rollout resets. The asynchronous
    producer writes batch k into its own partition while step k - 1 records, so several partitions live at once:
    the newest `keep_partitions` are kept (older ones can no longer be trained on), and rows leave when recorded.
    The producer adds from its thread while the trainer takes from the main one, hence the lock."""

    def __init__(self, keep_partitions: int = 1) -> None:
        self.partitions: OrderedDict[str, dict[str, tuple[Any, ...]]] = OrderedDict()
        self.keep = max(1, keep_partitions)
        self._lock = threading.Lock()
        warm_up()

    def add(self, partition: str, keys: Sequence[str], columns: dict[str, list[Any]], reset: bool) -> None:
        with self._lock:
            rows = {} if reset else self.partitions.pop(partition, {})
            for i, key in enumerate(keys):
                rows[key] = tuple(columns[name][i] for name in ROW_COLUMNS)
            self.partitions[partition] = rows  # the newest last
            while len(self.partitions) > self.keep:
                self.partitions.popitem(last=False)

    def take(self, keys: Sequence[str]) -> dict[str, list[Any]]:
        with self._lock:
            found = {k: rows[k] for rows in self.partitions.values() for k in keys if k in rows}
            missing = [k for k in keys if k not in found]
            if missing:
                raise KeyError(f"flight recorder: no rollout rows for {len(missing)} key(s), e.g. {missing[:3]}")
            for rows in self.partitions.values():
                for k in keys:
                    rows.pop(k, None)
        return {name: [found[k][j] for k in keys] for j, name in enumerate(ROW_COLUMNS)}


def export_rows(stash: RolloutStash, batches: Sequence[tuple[str, Sequence[str]]]) -> dict[str, Any]:
    """JSON-ready rows of `(partition, keys)` batches still in flight (an async checkpoint keeps them)."""
    with stash._lock:
        return {
            part: {k: list(stash.partitions[part][k]) for k in keys if k in stash.partitions.get(part, {})}
            for part, keys in batches
        }


def import_rows(stash: RolloutStash, saved: dict[str, Any]) -> None:
    """Put rows `export_rows` wrote back, one partition per batch (a resumed async run records those steps)."""
    for part, rows in saved.items():
        columns = {
            n: [r[j] if j < len(r) else _LATER_COLUMNS[n] for r in rows.values()] for j, n in enumerate(ROW_COLUMNS)
        }
        stash.add(part, list(rows), columns, True)


def record_from_store(client: DataPlaneClient, stash: RolloutStash, meta: KVBatchMeta, request: RecordRequest) -> str:
    """Join the stashed rows of `meta`'s keys with their store columns and the driver's, and write the step file."""
    columns: dict[str, RecordValue] = {"sample_key": list(meta.keys), **stash.take(meta.keys)}
    columns.update(read_store_columns(client, meta, request.fields))
    columns.update(request.driver_columns)
    path = write_step(request.rollouts_dir, request.step, columns, request.info, request.keep_last)
    return str(path)

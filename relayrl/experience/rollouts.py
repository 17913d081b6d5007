"""Multi-turn rollouts: generate, score, append the environment's answer, repeat; plus message-log flattening.

A message log is a list of messages `{"role", "content", "token_ids": LongTensor[n], ...}`; generated assistant
messages also carry `generation_logprobs` (FloatTensor[n]) and, when the environment flags them, `flags`. The
trainer turns finished logs into right-padded [B, S] training tensors with `add_token_loss_masks` and
`batched_message_log_to_flat_message`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog
from relayrl.experience.chat_render import ChatRenderer
from relayrl.experience.episodes import end_episodes, episode_envs, observation_ids, start_episodes
from relayrl.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec

log = logging.getLogger(__name__)

#: Rollout metrics under this prefix are the rollout's own clock (seconds spent inside it, e.g. in the environment),
#: not training metrics: the trainer moves them into its phase timers with `pop_rollout_timings` before the metrics
#: go anywhere else, so the training metrics stay what they were.
ROLLOUT_TIMING_PREFIX = "timing/"


def pop_rollout_timings(metrics: dict[str, Any]) -> dict[str, float]:
    """Take the `ROLLOUT_TIMING_PREFIX` entries out of `metrics`: {phase: seconds}."""
    keys = [k for k in metrics if k.startswith(ROLLOUT_TIMING_PREFIX)]
    return {k.removeprefix(ROLLOUT_TIMING_PREFIX): float(metrics.pop(k)) for k in keys}


#: Per-token message keys that flattening concatenates, with the value used for messages that lack the key.
#: A message without `generation_logprobs` was not sampled (0, as in GenerationOutputSpec); a missing
#: `advantage_override` means "no override" (NaN).
FLAT_KEYS: dict[str, float] = {
    "token_ids": 0,
    "token_loss_mask": 0,
    "generation_logprobs": 0.0,
    "generation_support": 0,
    "advantage_override": math.nan,
}
#: Per-token keys with a trailing dimension ([n, K] per message): the sampler's recorded kept sets (int32; 0 =
#: nothing recorded, e.g. a message that was not sampled), present only when sampling filters.
TRAILING_KEYS: frozenset[str] = frozenset({"generation_support"})


class Generator(Protocol):
    """What a rollout needs of a generation engine: sampling. (Any `GenerationInterface` is one.)"""

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]: ...


def run_multi_turn_rollout(
    policy_generation: Generator,
    input_batch: BatchedDataDict,
    tokenizer: Any,
    task_to_env: dict[str, EnvironmentInterface],
    max_seq_len: int,
    max_rollout_turns: int = 1,
    greedy: bool = False,
) -> tuple[BatchedDataDict, dict[str, Any]]:
    """Roll every row out for up to `max_rollout_turns` turns; returns the finished batch and rollout metrics.

    Per turn, for the rows still active: flatten their logs, generate, append the assistant message, score with
    the row's environment, append the observation message. The observation is appended even on the final turn
    (reference behaviour), so training sequences end with environment tokens that are in the input but masked
    from the loss. When prompt + generated + observation tokens reach `max_seq_len` the observation is cut to fit
    and the row is marked truncated and done (a row that merely lands exactly on the limit is flagged too,
    as in the reference). `truncated` is also set when the engine stopped on its token budget. The input batch
    is not modified; the result adds `total_reward` [B] float32 and `truncated` [B] bool.

    Rows of a per-rollout environment (`EpisodeEnvironment`, e.g. an `env.environment_factory` class) start with
    their episode's prompt rendered with the tool schemas; their observations are chat messages rendered as the
    template's continuation after the engine's own ids (token-in/token-out, `chat_render`); the episodes this
    loop stops (turn limit, sequence budget) are scored by the environment at the end.
    """
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise ValueError("tokenizer has no pad_token_id; rollouts right-pad generation inputs with it")
    missing = [k for k in ("message_log", "extra_env_info", "task_name") if k not in input_batch]
    if missing:
        raise ValueError(f"rollout input batch is missing keys: {', '.join(missing)}")
    batch = BatchedDataDict(input_batch)
    batch["message_log"] = [list(msgs) for msgs in input_batch["message_log"]]
    batch["extra_env_info"] = list(input_batch["extra_env_info"])
    n = len(batch["message_log"])
    stop_strings: list[Any] = list(input_batch.get("stop_strings") or [None] * n)
    total_reward = torch.zeros(n, dtype=torch.float32)  # [B]
    # Per-row bookkeeping in Python lists (tensors at the end): no tensor indexing per row and turn.
    truncated_rows = [False] * n
    terminated = torch.zeros(n, dtype=torch.bool)  # [B], ended by the environment
    turns = [0] * n
    gen_tokens = [0] * n
    env_tokens = [0] * n
    active = list(range(n))
    episodic = episode_envs(task_to_env)
    renderer = ChatRenderer(tokenizer) if episodic else None
    env_start = time.perf_counter()
    chat = start_episodes(batch, episodic, renderer, max_seq_len) if renderer is not None else {}
    env_s = time.perf_counter() - env_start  # the environment's share of the rollout (episode start, steps, end)

    for _ in range(max_rollout_turns):
        if not active:
            break
        logs = [batch["message_log"][i] for i in active]
        flat, input_lengths = batched_message_log_to_flat_message(logs, {"token_ids": pad_id})
        gen_input = BatchedDataDict(
            input_ids=flat["token_ids"],  # [A, S]
            input_lengths=input_lengths,  # [A]
            stop_strings=[stop_strings[i] for i in active],
        )
        out = policy_generation.generate(gen_input, greedy=greedy)
        done = [False] * len(active)
        gen_lens: list[int] = []
        starts = input_lengths.tolist()
        out_lens, out_truncated = out["generation_lengths"].tolist(), out["truncated"].tolist()
        out_ids = out["output_ids"].to(torch.long).unbind(0)  # per-row views, [S + N] each
        out_logprobs = out["logprobs"].to(torch.float32).unbind(0)
        out_support = out["support"].unbind(0) if "support" in out else None  # [S + N, K] per row
        for j, i in enumerate(active):
            start, g = int(starts[j]), int(out_lens[j])
            if out_truncated[j]:
                truncated_rows[i] = True
            if start + g > max_seq_len:  # an engine that ignored the context limit: keep what fits, flag it
                log.warning(
                    "row %d: generation ran %d tokens past max_seq_len=%d", i, start + g - max_seq_len, max_seq_len
                )
                g = max(0, max_seq_len - start)
                truncated_rows[i] = done[j] = True
            ids = out_ids[j][start : start + g]  # [g]
            message = {
                "role": "assistant",
                "content": tokenizer.decode(ids.tolist(), skip_special_tokens=True),
                "token_ids": ids,
                "generation_logprobs": out_logprobs[j][start : start + g],  # [g]
            }
            if out_support is not None:
                message["generation_support"] = out_support[j][start : start + g]  # [g, K]
            batch["message_log"][i].append(message)
            gen_lens.append(g)
            gen_tokens[i] += g

        env_start = time.perf_counter()
        env_out = calculate_rewards(
            logs, [batch["task_name"][i] for i in active], [batch["extra_env_info"][i] for i in active], task_to_env
        )
        env_s += time.perf_counter() - env_start
        total_reward[active] += env_out.rewards.to(torch.float32)
        # One batched tokenizer call for all observations (the same ids as one call each, far less overhead).
        plain = [j for j, o in enumerate(env_out.observations) if "chat" not in o]
        obs_token_ids: dict[int, list[int]] = {}
        if plain:
            texts = [env_out.observations[j]["content"] for j in plain]
            obs_token_ids = dict(zip(plain, tokenizer(texts, add_special_tokens=False)["input_ids"]))
        for j, i in enumerate(active):
            if env_out.message_flags is not None and env_out.message_flags[j]:
                batch["message_log"][i][-1]["flags"] = dict(env_out.message_flags[j])
            obs = env_out.observations[j]
            if "chat" in obs:  # chat messages: the template's continuation after this reply, tokenized once
                assert renderer is not None, "chat observations come from episode environments only"
                text, ids_j = observation_ids(renderer, chat, i, batch["message_log"][i][-1]["token_ids"], obs)
                obs_token_ids[j] = ids_j
                obs = {"role": obs["role"], "content": text, "messages": list(obs["chat"])}
                if "calls" in env_out.observations[j]:  # the tool calls that ran (name, arguments, status, latency)
                    obs["calls"] = list(env_out.observations[j]["calls"])
            else:
                obs = {"role": obs["role"], "content": obs["content"]}
            obs_ids = torch.tensor(obs_token_ids[j], dtype=torch.long)  # [o]
            used = int(starts[j]) + gen_lens[j]
            if used + len(obs_ids) >= max_seq_len:
                obs_ids = obs_ids[: max(0, max_seq_len - used)]
                truncated_rows[i] = done[j] = True
            batch["message_log"][i].append({**obs, "token_ids": obs_ids})
            env_tokens[i] += len(obs_ids)
            turns[i] += 1
            stop_strings[i] = env_out.next_stop_strings[j]
            batch["extra_env_info"][i] = env_out.metadata[j]
        env_done = env_out.terminateds.to(torch.bool)  # [A]
        terminated[active] |= env_done
        active = [i for i, d, e in zip(active, done, env_done.tolist()) if not (d or e)]

    if episodic:  # episodes this loop stopped (turn limit, budget) are scored by their environment
        env_start = time.perf_counter()
        end_episodes(batch, episodic, [i for i in range(n) if not terminated[i]], total_reward)
        env_s += time.perf_counter() - env_start
    max_turns_reached = torch.zeros(n, dtype=torch.bool)
    max_turns_reached[active] = True
    truncated = torch.tensor(truncated_rows, dtype=torch.bool)  # [B]
    batch["total_reward"] = total_reward
    batch["truncated"] = truncated
    total_tokens = torch.tensor([sum(len(m["token_ids"]) for m in msgs) for msgs in batch["message_log"]])
    turns_t = torch.tensor(turns, dtype=torch.long)  # [B]
    gen_tokens_t = torch.tensor(gen_tokens, dtype=torch.long)  # [B]
    metrics: dict[str, Any] = {
        "total_turns": int(turns_t.sum()),
        "avg_turns_per_sample": _mean(turns_t),
        "max_turns_per_sample": int(turns_t.max()) if n else 0,
        "natural_termination_rate": _mean(terminated),
        "truncation_rate": _mean(truncated),
        "max_turns_reached_rate": _mean(max_turns_reached),
        "mean_total_tokens_per_sample": _mean(total_tokens),
        "mean_gen_tokens_per_sample": _mean(gen_tokens_t),
        "max_gen_tokens_per_sample": int(gen_tokens_t.max()) if n else 0,
        "mean_env_tokens_per_sample": _mean(torch.tensor(env_tokens, dtype=torch.long)),
    }
    for env in {id(e): e for e in task_to_env.values()}.values():  # e.g. reward/<name> per reward function
        metrics.update(env.rollout_metrics())
    metrics[f"{ROLLOUT_TIMING_PREFIX}environment"] = env_s  # the caller's to pop (`pop_rollout_timings`)
    return batch, metrics


def _mean(t: torch.Tensor) -> float:
    return t.float().mean().item() if t.numel() else 0.0


def calculate_rewards(
    message_logs: Sequence[MessageLog],
    task_names: Sequence[str],
    extra_env_info: Sequence[dict[str, Any] | None],
    task_to_env: dict[str, EnvironmentInterface],
) -> EnvironmentReturn:
    """One `env.step` per task over that task's rows (messages reduced to role and content), back in row order."""
    n = len(message_logs)
    if not (len(task_names) == len(extra_env_info) == n):
        raise ValueError(f"calculate_rewards: {n} logs, {len(task_names)} task names, {len(extra_env_info)} infos")
    rows_by_task: dict[str, list[int]] = {}
    for i, task in enumerate(task_names):
        rows_by_task.setdefault(task, []).append(i)
    for task in rows_by_task:
        if task not in task_to_env:
            raise ValueError(f"No environment found for task type: {task}")

    observations: list[Any] = [None] * n
    metadata: list[Any] = [None] * n
    next_stop: list[Any] = [None] * n
    answers: list[str | None] = [None] * n
    flags: list[dict[str, bool]] = [{} for _ in range(n)]
    rewards = torch.zeros(n, dtype=torch.float32)  # [B]
    terminateds = torch.zeros(n, dtype=torch.bool)  # [B]
    any_answers = any_flags = False
    for task, rows in rows_by_task.items():
        logs = [[{"role": m["role"], "content": m["content"]} for m in message_logs[i]] for i in rows]
        ret = task_to_env[task].step(logs, [extra_env_info[i] for i in rows])
        if len(ret.observations) != len(rows) or ret.rewards.shape[0] != len(rows):
            raise ValueError(
                f"environment for task {task!r} returned {len(ret.observations)} observations and "
                f"{ret.rewards.shape[0]} rewards for {len(rows)} rows"
            )
        idx = torch.tensor(rows, dtype=torch.long)
        rewards[idx] = ret.rewards.to(torch.float32)
        terminateds[idx] = ret.terminateds.to(torch.bool)
        for j, i in enumerate(rows):
            observations[i], metadata[i], next_stop[i] = ret.observations[j], ret.metadata[j], ret.next_stop_strings[j]
        if ret.answers is not None:
            any_answers = True
            for j, i in enumerate(rows):
                answers[i] = ret.answers[j]
        if ret.message_flags is not None:
            any_flags = True
            for j, i in enumerate(rows):
                flags[i] = dict(ret.message_flags[j] or {})
    return EnvironmentReturn(
        observations=observations,
        metadata=metadata,
        next_stop_strings=next_stop,
        rewards=rewards,
        terminateds=terminateds,
        answers=answers if any_answers else None,
        message_flags=flags if any_flags else None,
    )


def batched_message_log_to_flat_message(
    message_logs: Sequence[MessageLog], pad_value_dict: dict[str, float], make_sequence_length_divisible_by: int = 1
) -> tuple[BatchedDataDict, torch.Tensor]:
    """Concatenate each row's per-token message tensors into right-padded [B, S] tensors; also returns lengths [B].

    Keys handled: those of `FLAT_KEYS` that at least one message carries. A message lacking such a key contributes
    that key's default (see `FLAT_KEYS`); padding uses `pad_value_dict[key]`, else the same default. S is the
    longest row rounded up to a multiple of `make_sequence_length_divisible_by`.
    """
    if make_sequence_length_divisible_by < 1:
        raise ValueError(f"make_sequence_length_divisible_by must be >= 1, got {make_sequence_length_divisible_by}")
    keys = [k for k in FLAT_KEYS if any(k in m for msgs in message_logs for m in msgs)]
    if "token_ids" not in keys:
        keys.insert(0, "token_ids")
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    dtypes: dict[str, torch.dtype] = {}
    trailing: dict[str, tuple[int, ...]] = {}  # a TRAILING_KEYS key's per-token shape, from its first message
    for k in keys:
        if k in TRAILING_KEYS:
            first = next(torch.as_tensor(m[k]) for msgs in message_logs for m in msgs if k in m)
            trailing[k] = tuple(first.shape[1:])
    row_lengths: list[int] = []
    for r, msgs in enumerate(message_logs):
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        row_length = 0
        for m_i, msg in enumerate(msgs):
            if "token_ids" not in msg:
                raise ValueError(f"row {r} message {m_i} ({msg.get('role')}) has no token_ids")
            n_tok = len(msg["token_ids"])
            row_length += n_tok
            for k in keys:
                if k in msg:
                    t = torch.as_tensor(msg[k])
                    if t.shape != (n_tok, *trailing.get(k, ())):
                        raise ValueError(f"row {r} message {m_i}: {k} has shape {tuple(t.shape)}, token_ids ({n_tok},)")
                    dtypes.setdefault(k, t.dtype)
                    parts[k].append(t)
                else:
                    parts[k].append(torch.full((n_tok, *trailing.get(k, ())), FLAT_KEYS[k]))  # dtype fixed below
        for k in keys:
            rows[k].append(parts[k])
        row_lengths.append(row_length)
    lengths = torch.tensor(row_lengths, dtype=torch.long)  # [B]
    longest = int(lengths.max()) if len(message_logs) else 0
    width = -(-longest // make_sequence_length_divisible_by) * make_sequence_length_divisible_by
    # Each row's tokens fill its first lengths[r] columns: one concatenation and one masked scatter per key
    # (row-major order) instead of a concatenation and a slice assignment per row.
    filled = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # [B, S]
    flat = BatchedDataDict()
    for k in keys:
        dtype = torch.long if k == "token_ids" else dtypes.get(k, torch.float32)
        pad = pad_value_dict.get(k, FLAT_KEYS[k])
        extra = trailing.get(k, ())
        out = torch.full((len(message_logs), width, *extra), pad, dtype=dtype)  # [B, S] (or [B, S, K])
        values = [p if p.dtype == dtype else p.to(dtype) for parts in rows[k] for p in parts]
        if values:
            out.masked_scatter_(filled.view(*filled.shape, *(1 for _ in extra)).expand_as(out), torch.cat(values))
        flat[k] = out
    return flat, lengths


def add_token_loss_masks(message_logs: Sequence[MessageLog], only_generated: bool = True) -> Sequence[MessageLog]:
    """Give every message a `token_loss_mask` (1 on assistant tokens, and with `only_generated` only on those
    sampled in this rollout) and a zero `generation_logprobs` where it has none. Edits in place; returns the logs.
    """
    for msgs in message_logs:
        for msg in msgs:
            n_tok = len(msg["token_ids"])
            trained = msg["role"] == "assistant" and (not only_generated or "generation_logprobs" in msg)
            msg["token_loss_mask"] = torch.full((n_tok,), int(trained), dtype=torch.long)  # [n]
            if "generation_logprobs" not in msg:
                msg["generation_logprobs"] = torch.zeros(n_tok, dtype=torch.float32)  # [n]
    return message_logs


def build_message_advantage_overrides(
    message_logs: Sequence[MessageLog], flag_to_advantage: dict[str, float]
) -> dict[str, int]:
    """Set `advantage_override` on every message: NaN (keep the estimator's advantage), or for an assistant message
    carrying a truthy flag from `flag_to_advantage` that flag's advantage (first match in dict order wins).

    Flattening then yields a [B, S] override tensor. Returns how many messages each flag overrode.
    """
    counts = dict.fromkeys(flag_to_advantage, 0)
    for msgs in message_logs:
        for msg in msgs:
            value = math.nan
            if msg["role"] == "assistant":
                flags = msg.get("flags") or {}
                hit = next((f for f in flag_to_advantage if flags.get(f)), None)
                if hit is not None:
                    value = flag_to_advantage[hit]
                    counts[hit] += 1
            msg["advantage_override"] = torch.full((len(msg["token_ids"]),), value, dtype=torch.float32)  # [n]
    return counts


def aggregate_rollout_metrics(metric_dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Combine metrics of several rollout batches: `/min` or `min_` keys take the min, `/max` or `max_` the max,
    `total_turns` is summed, everything else numeric is averaged, rates always (`max_turns_reached_rate` is a share
    of rows, not a maximum); non-numeric values pass through (the last one seen).
    """
    values: dict[str, list[Any]] = {}
    for d in metric_dicts:
        for k, v in d.items():
            values.setdefault(k, []).append(v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
    out: dict[str, Any] = {}
    for k, vs in values.items():
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in vs):
            out[k] = vs[-1]
        elif k.endswith("_rate"):
            out[k] = sum(vs) / len(vs)
        elif k.endswith("/min") or k.startswith("min_"):
            out[k] = min(vs)
        elif k.endswith("/max") or k.startswith("max_"):
            out[k] = max(vs)
        elif k == "total_turns":
            out[k] = sum(vs)
        else:
            out[k] = sum(vs) / len(vs)
    for k in [k for k in out if k.endswith("/tool_call_validity")]:  # pooled over the batches, not a mean of ratios
        prefix = k.removesuffix("tool_call_validity")
        valid, invalid = out.get(prefix + "tool_calls", 0.0), out.get(prefix + "invalid_tool_calls", 0.0)
        if valid + invalid:
            out[k] = valid / (valid + invalid)
    return out


def trim_to_last_loss_token(
    flat: BatchedDataDict,
    lengths: torch.Tensor,
    pad_value_dict: dict[str, float],
    make_sequence_length_divisible_by: int = 1,
) -> tuple[BatchedDataDict, torch.Tensor]:
    """Cut every row right after its last loss token (rows without one keep their length), then re-pad.

    Tokens after a row's last loss token cannot change any loss, logprob or advantage of the loss tokens (attention
    is causal and they carry no loss), yet the reference keeps the final environment observation in the training
    sequence: here it is dropped before the logprob and training passes, which saves a quarter of their work on short
    answers. Returns (trimmed batch, new lengths [B]).
    """
    mask = flat["token_loss_mask"]  # [B, S]
    positions = torch.arange(mask.shape[1])  # [S]
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values if mask.numel() else torch.zeros(0)  # [B]
    new_lengths = torch.where(last >= 0, last + 1, lengths).to(lengths.dtype)  # [B]
    longest = int(new_lengths.max()) if new_lengths.numel() else 0
    m = make_sequence_length_divisible_by
    width = -(-longest // m) * m
    keep = positions[:width].unsqueeze(0) < new_lengths.unsqueeze(1)  # [B, W]
    out: BatchedDataDict = BatchedDataDict()
    for k, v in flat.items():
        if isinstance(v, torch.Tensor) and v.dim() == 2:
            pad = pad_value_dict.get(k, FLAT_KEYS.get(k, 0))
            out[k] = torch.where(keep, v[:, :width], torch.full_like(v[:, :width], pad))  # [B, W]
        elif k in TRAILING_KEYS and isinstance(v, torch.Tensor):  # [B, S, K]: zeros (nothing recorded) after
            out[k] = torch.where(keep.unsqueeze(-1), v[:, :width], 0)  # [B, W, K]
        else:
            out[k] = v
    return out, new_lengths


def with_support(train_data: BatchedDataDict, flat: BatchedDataDict) -> BatchedDataDict:
    """Carry the flattened `generation_support` [B, S, K] (the sampler's kept sets) into `train_data` when the
    rollout recorded one; edits in place."""
    if "generation_support" in flat:
        train_data["generation_support"] = flat["generation_support"]
    return train_data


def support_keys(data: BatchedDataDict) -> list[str]:
    """["generation_support"] when `data` carries the sampler's kept sets, else []: what a log-prob pass adds."""
    return ["generation_support"] if "generation_support" in data else []

"""SyncRolloutActor: one call per step that generates, scores, flattens and writes the rollout to the data plane.

`rollout_to_tq` runs the same multi-turn rollout and the same flatten as the legacy trainer
(`run_multi_turn_rollout`, `add_token_loss_masks` as the legacy trainer masks, `batched_message_log_to_flat_message`),
so the store holds bit for bit the tensors the legacy trainer would build. The bulk (`input_ids`,
`input_lengths`, `generation_logprobs`, `token_mask`, `sample_mask`) is written once, unpadded, under keys minted
here as `f"{uid}_g{i}"`; only per-row scalars and the small prompt ids (for grouping) return to the driver.

Keys: one uid per prompt, a fresh `uuid4().hex` unless the caller passes `uids` (e.g. derived from
`input_batch["idx"]` for reproducible logs). uuid4 is the default because dataset indices can repeat within one
partition (dynamic sampling across an epoch boundary), and a repeated key would overwrite a live sample.

On the local executor this is a plain object in the driver process; a Ray executor hosts it as an actor (it
attaches to the store with `bootstrap=False` either way).
"""

from __future__ import annotations

import hashlib
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from relayrl.algorithms.advantages import message_level_advantages
from relayrl.config import DataPlaneConfig, MasterConfig
from relayrl.data_plane.column_io import first_write
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.data_plane.schema import (
    ADVANTAGE_OVERRIDE,
    GENERATION_LOGPROBS,
    GENERATION_SUPPORT,
    INPUT_IDS,
    INPUT_LENGTHS,
    ROLLOUT_METRICS,
    SAMPLE_MASK,
    TOKEN_MASK,
    VAL_PARTITION,
    sample_key,
)
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface, MessageLog
from relayrl.experience.carry_wire import encode_carry
from relayrl.experience.flight_recorder import RecordRequest, RolloutStash, record_from_store, rollout_rows
from relayrl.experience.rollouts import (
    ROLLOUT_TIMING_PREFIX,
    add_token_loss_masks,
    batched_message_log_to_flat_message,
    build_message_advantage_overrides,
    pop_rollout_timings,
    run_multi_turn_rollout,
    trim_to_last_loss_token,
)

#: Per-row values every rollout returns to the driver (scalars, plus prompt ids `[B, P]` to group rows by prompt).
#: `loss_token_counts` lets the driver rebuild `advantages[token_mask * sample_mask > 0]` for per-row advantages
#: (`adv.repeat_interleave(counts)`, the same values in the same order) without fetching the token mask.
DEFAULT_CARRY_KEYS: tuple[str, ...] = (
    "total_reward",
    "loss_multiplier",
    "truncated",
    "length",
    "input_lengths",
    "prompt_ids",
    "prompt_group",
    "response_token_lengths",
    "loss_token_counts",
)
#: Extra per-row values a caller may ask for with `carry_keys` (text for sample logging; never token tensors).
OPT_IN_CARRY_KEYS: tuple[str, ...] = (
    "sample_text",
    "message_log",
    "turn_roles",
    "turn_contents",
    "idx",
    "task_name",
    "extra_env_info",
)


def flatten_for_store(
    message_logs: Sequence[MessageLog],
    pad_id: int,
    multiple: int,
    only_generated: bool = True,
    flag_to_advantage: Mapping[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """The legacy trainer's training tensors for finished logs (masks added on shallow copies of the messages,
    so the caller's logs are left as they are): `input_ids`, `input_lengths`, `generation_logprobs`, `token_mask`,
    and with `flag_to_advantage` (message-level penalties) `advantage_override`, as the legacy GRPO trainer builds it.

    `only_generated` as in `add_token_loss_masks`: GRPO trains on the tokens sampled in this rollout only, PPO (like
    its legacy trainer) on every assistant message, including those a few-shot prompt brings."""
    logs = [[dict(m) for m in msgs] for msgs in message_logs]
    add_token_loss_masks(logs, only_generated=only_generated)
    if flag_to_advantage:
        build_message_advantage_overrides(logs, dict(flag_to_advantage))
    flat, input_lengths = trim_to_last_loss_token(
        *batched_message_log_to_flat_message(logs, pad_value_dict={"token_ids": pad_id}),
        pad_value_dict={"token_ids": pad_id},
        make_sequence_length_divisible_by=multiple,
    )
    out = {
        INPUT_IDS: flat["token_ids"],  # [B, S]
        INPUT_LENGTHS: input_lengths,  # [B]
        GENERATION_LOGPROBS: flat["generation_logprobs"],  # [B, S]
        TOKEN_MASK: flat["token_loss_mask"],  # [B, S]
    }
    if flag_to_advantage:
        out[ADVANTAGE_OVERRIDE] = flat["advantage_override"]  # [B, S], NaN where not overridden
    if "generation_support" in flat:  # the sampler's kept sets (sampling filters): the log-prob passes apply them
        out[GENERATION_SUPPORT] = flat["generation_support"]  # [B, S, K]
    return out


def _first_assistant_length(msgs: MessageLog) -> int:
    return next((len(m["token_ids"]) for m in msgs if m["role"] == "assistant"), 0)


def _sample_text(msgs: MessageLog) -> tuple[str, str]:
    """(prompt, completion) text of one row, as samples.jsonl logs it: system/user turns, then assistant turns."""
    prompt = "".join(m["content"] for m in msgs if m["role"] in ("system", "user"))
    return prompt, "".join(m["content"] for m in msgs if m["role"] == "assistant")


class SyncRolloutActor:
    """Owns the generation engine handle, the environments and a data-plane client (attached, not bootstrapped)."""

    def __init__(
        self,
        policy_generation: Any,
        tokenizer: Any,
        task_to_env: dict[str, EnvironmentInterface],
        master_config: MasterConfig,
        dp_cfg: DataPlaneConfig | Mapping[str, Any],
    ) -> None:
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("SyncRolloutActor: the tokenizer has no pad_token_id; flattening pads input_ids with it")
        self.policy_generation = policy_generation
        self.tokenizer = tokenizer
        self.task_to_env = task_to_env
        self.master_config = master_config
        self.client: DataPlaneClient = build_data_plane_client(dp_cfg, bootstrap=False)
        # the flight recorder's per-sample text and rewards, by key, until the step's file is written
        async_grpo = master_config.grpo.async_grpo
        in_flight = 2 + async_grpo.max_trajectory_age_steps if async_grpo.enabled else 1  # batches alive at once
        self.flight = RolloutStash(in_flight) if master_config.logger.flight_recorder.enabled else None
        #: Message-level penalties (`grpo.invalid_tool_call_advantage`, ...): {message flag: advantage}.
        self.flag_to_advantage = message_level_advantages(master_config) if master_config.algorithm == "grpo" else {}

    def rollout_to_tq(
        self,
        input_batch: BatchedDataDict,
        *,
        partition_id: str,
        group_size: int = 1,
        first_iter: bool = True,
        finish_generation: bool = True,
        task_to_env_override: dict[str, EnvironmentInterface] | None = None,
        carry_keys: Sequence[str] | None = None,
        uids: Sequence[str] | None = None,
        greedy: bool = False,
        text_rows: int | None = None,
        row_tags: Mapping[str, Any] | None = None,
    ) -> tuple[KVBatchMeta, dict[str, Any], dict[str, Any]]:
        """Roll out `input_batch` (already repeat-interleaved: the `group_size` rows of a prompt are contiguous),
        write its bulk to `partition_id`, return `(meta, wire_carry, rollout_metrics)`.

        The caller prepares the engine (`prepare_for_generation`); with `finish_generation` the actor releases it
        after the rollout. The driver carry comes back in its wire form (`encode_carry`, the smallest exact
        encoding: on Ray it is what crosses to the driver); `decode_carry` gives back the per-row values and
        `wire_nbytes` its size. `carry_keys` replaces the default carry with exactly these keys (defaults and
        `OPT_IN_CARRY_KEYS`). `uids` (one per prompt) replace the random uuid4 uids. `text_rows` builds the opt-in
        text values only for the first `text_rows` rows (the rest are None): the driver logs a few samples, so the
        whole batch's text need not cross to it. `row_tags` are stored as every row's tags (asynchronous GRPO
        stamps the generating `weight_version`).
        """
        n_rows = _check_rows(input_batch)
        num_prompts = _check_grouping(n_rows, group_size)
        uid_list = _check_uids(uids, num_prompts)
        cfg = self.master_config
        pad_id = int(self.tokenizer.pad_token_id)
        prompt_flat, prompt_lengths = batched_message_log_to_flat_message(
            input_batch["message_log"], pad_value_dict={"token_ids": pad_id}
        )
        prompt_ids = prompt_flat["token_ids"]  # [B, P], exactly the legacy trainer's prompt_ids
        _check_groups_share_prompts(prompt_ids, group_size)

        gen = self.policy_generation
        if first_iter and callable(getattr(gen, "snapshot_step_metrics", None)):
            gen.snapshot_step_metrics()
        final, rollout_metrics = run_multi_turn_rollout(
            gen,
            input_batch,
            self.tokenizer,
            task_to_env_override if task_to_env_override is not None else self.task_to_env,
            max_seq_len=cfg.policy.max_total_sequence_length,
            max_rollout_turns=cfg.rollout.max_rollout_turns,
            greedy=greedy,
        )
        bulk = flatten_for_store(
            final["message_log"],
            pad_id,
            cfg.policy.make_sequence_length_divisible_by,
            only_generated=cfg.algorithm != "ppo",  # the loss mask of the matching legacy trainer
            flag_to_advantage=self.flag_to_advantage if partition_id != VAL_PARTITION else None,  # no loss there
        )
        bulk[SAMPLE_MASK] = final["loss_multiplier"].clone().float()  # [B], legacy sample_mask before filtering
        timings = pop_rollout_timings(rollout_metrics)  # the rollout's clock is not stored with its rows

        keys = [sample_key(uid, i) for uid in uid_list for i in range(group_size)]
        write_start = time.perf_counter()
        meta = first_write(
            bulk,
            keys=keys,
            client=self.client,
            partition_id=partition_id,
            extra_info={ROLLOUT_METRICS: dict(rollout_metrics)},
            task_name=partition_id,
            pad_to_multiple=cfg.policy.make_sequence_length_divisible_by,
            tags=None if row_tags is None else [dict(row_tags) for _ in keys],
        )

        timings["data_plane"] = time.perf_counter() - write_start
        if self.flight is not None and partition_id != VAL_PARTITION:
            group = prompt_group_ids(prompt_ids, prompt_lengths)  # [B]
            self.flight.add(partition_id, keys, _flight_rows(final, prompt_lengths, group), reset=first_iter)
        if finish_generation:
            gen.finish_generation()
        carry = self._driver_carry(final, bulk, prompt_ids, prompt_lengths, carry_keys, text_rows)
        rollout_metrics.update({f"{ROLLOUT_TIMING_PREFIX}{k}": v for k, v in timings.items()})  # the caller's to pop
        return meta, encode_carry(carry, group_size), rollout_metrics

    def _driver_carry(
        self,
        final: BatchedDataDict,
        bulk: Mapping[str, torch.Tensor],
        prompt_ids: torch.Tensor,
        prompt_lengths: torch.Tensor,
        carry_keys: Sequence[str] | None,
        text_rows: int | None = None,
    ) -> BatchedDataDict:
        """Per-row values for the driver; the opt-in text values are built only when asked for (and with
        `text_rows`, only for that many leading rows: None stands in for the others)."""
        wanted = list(DEFAULT_CARRY_KEYS if carry_keys is None else carry_keys)
        unknown = [k for k in wanted if k not in DEFAULT_CARRY_KEYS and k not in OPT_IN_CARRY_KEYS]
        if unknown:
            raise KeyError(
                f"carry_keys {unknown} are not available; valid: {list(DEFAULT_CARRY_KEYS) + list(OPT_IN_CARRY_KEYS)}"
            )
        logs = final["message_log"]
        text_logs = logs if text_rows is None else [m if i < text_rows else None for i, m in enumerate(logs)]
        builders: dict[str, Any] = {
            "total_reward": lambda: final["total_reward"],  # [B] float32
            "loss_multiplier": lambda: final["loss_multiplier"],  # [B]
            "truncated": lambda: final["truncated"].to(torch.bool),  # [B]
            "length": lambda: final["length"] if "length" in final else prompt_lengths,  # [B] prompt tokens
            "input_lengths": lambda: bulk[INPUT_LENGTHS],  # [B]
            "prompt_ids": lambda: prompt_ids,  # [B, P]
            "prompt_group": lambda: prompt_group_ids(prompt_ids, prompt_lengths),  # [B] int64, equal iff same prompt
            "response_token_lengths": lambda: torch.tensor([_first_assistant_length(m) for m in logs]),  # [B]
            "loss_token_counts": lambda: bulk[TOKEN_MASK].sum(dim=-1),  # [B] int64: tokens with token_mask 1
            "message_log": lambda: [
                None if msgs is None else [{"role": m["role"], "content": m["content"]} for m in msgs]
                for msgs in text_logs
            ],
            "sample_text": lambda: [None if msgs is None else _sample_text(msgs) for msgs in text_logs],
            "turn_roles": lambda: [None if msgs is None else [m["role"] for m in msgs] for msgs in text_logs],
            "turn_contents": lambda: [None if msgs is None else [m["content"] for m in msgs] for msgs in text_logs],
            "idx": lambda: final["idx"],
            "task_name": lambda: list(final["task_name"]),
            "extra_env_info": lambda: list(final["extra_env_info"]),
        }
        missing = [k for k in wanted if k in ("idx", "task_name", "extra_env_info") and k not in final]
        if missing:
            raise KeyError(f"carry_keys {missing} requested but the input batch has no such key")
        return BatchedDataDict({k: builders[k]() for k in wanted})

    # ------------------------------------------------------------------ observability and lifecycle
    def record_step(self, meta: KVBatchMeta, request: RecordRequest, rows_from: SyncRolloutActor | None = None) -> str:
        """Write the flight recorder file of a step whose keys are still in the store; returns its path.
        `rows_from`: the actor that rolled the step out, when not this one (the async producer, whose client
        stays its own thread's: the store is read through this actor's)."""
        stash = (rows_from if rows_from is not None else self).flight
        if stash is None:
            raise RuntimeError("record_step: logger.flight_recorder.enabled is false for this run")
        return record_from_store(self.client, stash, meta, request)

    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]:
        """This actor's client counters (its puts are the bulk of what a step writes to the store)."""
        return self.client.metrics(reset)

    def shutdown(self) -> bool:
        """Detach from the store (the driver owns and closes it)."""
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - detaching must not fail a finished run
            pass
        return True


# ---------------------------------------------------------------------------------------------------- carry helpers
def _flight_rows(final: BatchedDataDict, prompt_lengths: torch.Tensor, group: torch.Tensor) -> dict[str, list[Any]]:
    return rollout_rows(
        final["message_log"],
        final["total_reward"],
        final["loss_multiplier"],
        final["truncated"],
        final["length"] if "length" in final else prompt_lengths,
        group,
        final.get("task_name"),
        final.get("extra_env_info"),
    )


def prompt_group_ids(prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """[B] int64 ids equal exactly when two rows have the same prompt tokens (a 64-bit BLAKE2 digest of them).

    Grouping by these ids partitions rows exactly as grouping by the padded prompt rows does, for 8 bytes a row
    instead of the whole prompt; a collision needs ~2^32 distinct prompts in one step.
    """
    out = []
    for row, n in zip(prompt_ids.tolist(), prompt_lengths.tolist()):
        digest = hashlib.blake2b(struct.pack(f"<{n}q", *row[:n]), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(out, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------- checks
def _check_rows(batch: Any) -> int:
    if not isinstance(batch, dict):
        raise TypeError(f"rollout_to_tq: input_batch must be a BatchedDataDict, got {type(batch).__name__}")
    missing = [k for k in ("message_log", "loss_multiplier") if k not in batch]
    if missing:
        raise ValueError(f"rollout_to_tq: input_batch is missing {missing}")
    n = len(batch["message_log"])
    if n == 0:
        raise ValueError("rollout_to_tq: input_batch is empty")
    return n


def _check_grouping(n_rows: int, group_size: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"rollout_to_tq: group_size must be a positive int, got {group_size!r}")
    if n_rows % group_size:
        raise ValueError(f"rollout_to_tq: {n_rows} rows are not a multiple of group_size={group_size}")
    return n_rows // group_size


def _check_uids(uids: Sequence[str] | None, num_prompts: int) -> list[str]:
    if uids is None:
        return [uuid.uuid4().hex for _ in range(num_prompts)]
    out = list(uids)
    if len(out) != num_prompts:
        raise ValueError(f"rollout_to_tq: {len(out)} uids given for {num_prompts} prompts (one uid per prompt)")
    if not all(isinstance(u, str) and u for u in out):
        raise ValueError("rollout_to_tq: uids must be non-empty strings")
    if len(set(out)) != len(out):
        raise ValueError("rollout_to_tq: uids must be unique (a repeated uid would overwrite live samples)")
    return out


def _check_groups_share_prompts(prompt_ids: torch.Tensor, group_size: int) -> None:
    """Keys `uid_g0..` assume the rows of a prompt are contiguous; a batch that is not repeat-interleaved fails."""
    if group_size == 1:
        return
    grouped = prompt_ids.view(-1, group_size, prompt_ids.shape[1])  # [P, G, L]
    bad = (grouped != grouped[:, :1]).flatten(1).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"rollout_to_tq: rows of prompt group(s) {bad[:8]} differ; input_batch must be repeat_interleave'd "
            f"(the {group_size} rows of one prompt contiguous)"
        )

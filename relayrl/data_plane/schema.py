"""Names shared by the driver, the workers and the store: field sets, `extra_info` keys, partition and task names.

Keeping them in one place means a typo is an import error, not a silently missing column.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------- fields
INPUT_IDS = "input_ids"
INPUT_LENGTHS = "input_lengths"
SAMPLE_MASK = "sample_mask"
TOKEN_MASK = "token_mask"
GENERATION_LOGPROBS = "generation_logprobs"
PREV_LOGPROBS = "prev_logprobs"
REFERENCE_POLICY_LOGPROBS = "reference_policy_logprobs"
ADVANTAGES = "advantages"
TOTAL_REWARD = "total_reward"
REWARDS = "rewards"
"""PPO's per-row scalar reward after shaping (GAE reads it; the policy loss reads it for the positive-example NLL)."""
GENERATION_SUPPORT = "generation_support"
"""The sampler's top-k/top-p kept set of each generated token, [N, S, K] int32 (`sampling.support_record`); written
only when generation filters (a run without top-k/top-p has no such field)."""
ROUTED_EXPERTS = "routed_experts"
ADVANTAGE_OVERRIDE = "advantage_override"
"""Message-level advantage penalties per token (NaN: keep the estimator's), written by the rollout only when
`grpo.invalid_tool_call_advantage` or another message-level penalty is set."""

DP_TRAIN_FIELDS: tuple[str, ...] = (
    INPUT_IDS,
    INPUT_LENGTHS,
    GENERATION_LOGPROBS,
    PREV_LOGPROBS,
    REFERENCE_POLICY_LOGPROBS,
    ADVANTAGES,
    TOKEN_MASK,
    SAMPLE_MASK,
)
"""What a training worker fetches for one step (order matters for reproducible logs)."""

PARTITION_FIELDS: tuple[str, ...] = (*DP_TRAIN_FIELDS, ADVANTAGE_OVERRIDE, GENERATION_SUPPORT)
"""Every field a step's (or validation batch's) partition may hold: the train fields, the per-token penalties a
rollout writes when message-level advantage penalties are set, and the sampler's kept sets when sampling filters."""

ASYNC_PARTITION_FIELDS: tuple[str, ...] = (*DP_TRAIN_FIELDS, ADVANTAGE_OVERRIDE, GENERATION_SUPPORT)
"""What an asynchronous producer's partitions declare: as a step's (`PARTITION_FIELDS`)."""

LP_SEED_FIELDS: tuple[str, ...] = (INPUT_IDS, INPUT_LENGTHS, TOKEN_MASK, SAMPLE_MASK)
"""What a log-prob worker (policy or reference) fetches."""

TOKEN_ALIGNED_FIELDS: frozenset[str] = frozenset(
    {
        INPUT_IDS,
        GENERATION_LOGPROBS,
        GENERATION_SUPPORT,
        PREV_LOGPROBS,
        REFERENCE_POLICY_LOGPROBS,
        ADVANTAGES,
        TOKEN_MASK,
        ROUTED_EXPERTS,
        ADVANTAGE_OVERRIDE,
    }
)
"""Per-token fields: written jagged (unpadded, by `sequence_lengths`) when given as `[N, S, ...]` tensors."""

# ---------------------------------------------------------------------------------------------------- extra_info keys
GLOBAL_FORWARD_PAD_SEQLEN = "global_forward_pad_seqlen"
"""Absolute padded width every DP rank materializes to, so all ranks share one sequence dimension."""
PAD_TO_MULTIPLE = "pad_to_multiple"
MICRO_BATCH_INDICES = "micro_batch_indices"
MICRO_BATCH_LENGTHS = "micro_batch_lengths"
ELEM_COUNTS_PER_GB = "elem_counts_per_gb"
ROLLOUT_METRICS = "rollout_metrics"

PACKING_INFO_KEYS: tuple[str, ...] = (MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS, ELEM_COUNTS_PER_GB)
"""Per-rank packing metadata that `shard_meta_for_dp` writes and the worker trusts over local re-packing."""

# ---------------------------------------------------------------------------------------------------- partitions, tasks
TRAIN_PARTITION = "train"
VAL_PARTITION = "val"
TASK_PREV_LP = "prev_lp"
TASK_REF_LP = "ref_lp"
TASK_TRAIN = "train"
TRAIN_CONSUMER_TASKS: tuple[str, ...] = (TASK_PREV_LP, TASK_REF_LP, TASK_TRAIN)


def sample_key(uid: str, generation: int) -> str:
    """The key of generation `generation` of prompt `uid`; minted once at rollout and reused by every stage."""
    return f"{uid}_g{generation}"


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= `value` (`value` itself when `multiple <= 1`)."""
    if multiple <= 1:
        return value
    return -(-value // multiple) * multiple

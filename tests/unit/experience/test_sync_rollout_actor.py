"""SyncRolloutActor on the memory backend with a tiny Qwen2: the store holds exactly the legacy flatten."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.config import DataPlaneConfig, MasterConfig
from relayrl.data_plane.column_io import read_columns
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import DataPlaneClient, DataPlaneClosedError
from relayrl.data_plane.schema import DP_TRAIN_FIELDS, GLOBAL_FORWARD_PAD_SEQLEN, PAD_TO_MULTIPLE, round_up
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from relayrl.experience.carry_wire import decode_carry
from relayrl.experience.rollouts import (
    add_token_loss_masks,
    batched_message_log_to_flat_message,
    pop_rollout_timings,
    run_multi_turn_rollout,
    trim_to_last_loss_token,
)
from relayrl.experience.sync_rollout_actor import SyncRolloutActor
from relayrl.models.generation.hf_generation import HfGeneration

DP_CFG = DataPlaneConfig(enabled=True, backend="memory", storage_capacity=1000)
BULK = ["input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask"]
G = 3  # generations per prompt


class CountingEnv(EnvironmentInterface):
    """Two turns per episode; reward = number of digits in the latest answer (varied, so groups differ)."""

    def step(self, message_log_batch: list[Any], metadata: list[Any]) -> EnvironmentReturn:
        turns = [(m or {}).get("turn", 0) + 1 for m in metadata]
        answers = [log[-1]["content"] for log in message_log_batch]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"turn {t} ok"} for t in turns],
            metadata=[{"turn": t} for t in turns],
            next_stop_strings=[None] * len(turns),
            rewards=torch.tensor([float(sum(c.isdigit() for c in a)) for a in answers]),
            terminateds=torch.tensor([t >= 2 for t in turns]),
        )


class RecordingEngine(HfGeneration):
    """The real engine plus the optional step-metrics hook the actor calls when an engine has it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[str] = []

    def snapshot_step_metrics(self) -> None:
        self.events.append("snapshot")

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        self.events.append("finish")
        return super().finish_generation(*args, **kwargs)


def master_config(model_dir: Path) -> MasterConfig:
    return MasterConfig.model_validate(
        {
            "policy": {
                "model_name": str(model_dir),
                "train_global_batch_size": 6,
                "train_micro_batch_size": 3,
                "max_total_sequence_length": 48,
                "make_sequence_length_divisible_by": 8,
                "generation": {"max_new_tokens": 8},
            },
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": G, "max_rollout_turns": 2},
        }
    )


def prompt_batch(tok: Any) -> BatchedDataDict:
    """Two prompts: a plain question, and one whose prompt already holds an assistant turn (history, no logprobs)."""
    convs = [
        [{"role": "user", "content": "12+30="}],
        [
            {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "7+5="},
        ],
    ]
    logs = []
    for conv in convs:
        full = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        cuts = [len(tok.apply_chat_template(conv[: i + 1], tokenize=False)) for i in range(len(conv) - 1)]
        bounds = [0, *cuts, len(full)]
        pieces = [(m["role"], full[a:b]) for m, a, b in zip(conv, bounds, bounds[1:])]
        logs.append(
            [
                {"role": r, "content": t, "token_ids": torch.tensor(tok(t, add_special_tokens=False)["input_ids"])}
                for r, t in pieces
            ]
        )
    return BatchedDataDict(
        message_log=logs,
        length=torch.tensor([sum(len(m["token_ids"]) for m in log) for log in logs]),
        extra_env_info=[{"ground_truth": "42"}, {"ground_truth": "12"}],
        task_name=["count", "count"],
        loss_multiplier=torch.tensor([1.0, 0.5]),
        idx=torch.tensor([10, 11]),
    )


@pytest.fixture
def setup(tiny_model_dir: Path, char_tokenizer: Any) -> Iterator[SimpleNamespace]:
    driver: DataPlaneClient = build_data_plane_client(DP_CFG, bootstrap=True)
    driver.register_partition("train", list(DP_TRAIN_FIELDS), 6, ["prev_lp", "ref_lp", "train"], G)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    source = SimpleNamespace(model=model, weights_version=0)
    cfg = master_config(tiny_model_dir)

    def engine(seed: int = 7) -> RecordingEngine:
        return RecordingEngine(cfg.policy.generation, char_tokenizer, source, max_total_sequence_length=48, seed=seed)

    envs: dict[str, EnvironmentInterface] = {"count": CountingEnv()}
    actor = SyncRolloutActor(engine(), char_tokenizer, envs, cfg, DP_CFG)
    yield SimpleNamespace(driver=driver, actor=actor, engine=engine, cfg=cfg, envs=envs, tok=char_tokenizer)
    actor.shutdown()
    driver.close()


def materialize_step(driver: DataPlaneClient, meta: Any) -> BatchedDataDict:
    meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = round_up(max(meta.sequence_lengths), meta.extra_info[PAD_TO_MULTIPLE])
    return read_columns(driver, meta, BULK, pad_value_dict={"input_ids": 0})


def test_store_columns_equal_the_legacy_flatten_bit_for_bit(setup: SimpleNamespace) -> None:
    s = setup
    repeated = prompt_batch(s.tok).repeat_interleave(G)
    meta, wire, metrics = s.actor.rollout_to_tq(repeated, partition_id="train", group_size=G)
    carry = decode_carry(wire)
    assert all("token_loss_mask" not in m for log in repeated["message_log"] for m in log)  # input untouched

    # ---- the legacy trainer's lines, on an identically seeded engine ----
    pad_id = s.tok.pad_token_id
    prompt_flat, _ = batched_message_log_to_flat_message(repeated["message_log"], pad_value_dict={"token_ids": pad_id})
    legacy, legacy_metrics = run_multi_turn_rollout(
        s.engine(), repeated, s.tok, s.envs, max_seq_len=48, max_rollout_turns=2, greedy=False
    )
    loss_multiplier = legacy["loss_multiplier"].clone().float()
    add_token_loss_masks(legacy["message_log"], only_generated=True)
    flat, input_lengths = trim_to_last_loss_token(  # exactly the legacy trainer's training tensors
        *batched_message_log_to_flat_message(legacy["message_log"], pad_value_dict={"token_ids": pad_id}),
        pad_value_dict={"token_ids": pad_id},
        make_sequence_length_divisible_by=8,
    )
    want: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=flat["token_ids"],
        input_lengths=input_lengths,
        generation_logprobs=flat["generation_logprobs"],
        token_mask=flat["token_loss_mask"],
        sample_mask=loss_multiplier,
    )

    got = materialize_step(s.driver, meta)
    for key in BULK:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    # the rollout's own clock goes back to the trainer's breakdown, never into the metrics or the store
    assert set(pop_rollout_timings(metrics)) == {"environment", "data_plane"}
    assert set(pop_rollout_timings(legacy_metrics)) == {"environment"}
    assert metrics == legacy_metrics and meta.extra_info["rollout_metrics"] == legacy_metrics
    assert float(want["token_mask"].sum()) > 0 and float(want["generation_logprobs"].abs().sum()) > 0
    user, history = repeated["message_log"][G][:2]  # prompt 2's assistant history turn: in the input, not the loss
    start, stop = len(user["token_ids"]), len(user["token_ids"]) + len(history["token_ids"])
    assert history["role"] == "assistant" and stop > start and got["token_mask"][G, start:stop].eq(0).all()

    default_keys = "total_reward loss_multiplier truncated length input_lengths prompt_ids prompt_group"
    assert list(carry) == [*default_keys.split(), "response_token_lengths", "loss_token_counts"]
    assert torch.equal(carry["loss_token_counts"], want["token_mask"].sum(-1))
    # group ids partition rows exactly as the prompt token rows do
    same_ids = carry["prompt_group"].unsqueeze(0) == carry["prompt_group"].unsqueeze(1)
    same_rows = (carry["prompt_ids"].unsqueeze(0) == carry["prompt_ids"].unsqueeze(1)).all(-1)
    assert torch.equal(same_ids, same_rows)
    assert torch.equal(carry["total_reward"], legacy["total_reward"]) and carry["total_reward"].dtype == torch.float32
    assert torch.equal(carry["truncated"], legacy["truncated"]) and carry["truncated"].dtype == torch.bool
    assert torch.equal(carry["prompt_ids"], prompt_flat["token_ids"])
    assert torch.equal(carry["input_lengths"], input_lengths) and torch.equal(carry["length"], repeated["length"])
    assert torch.equal(carry["loss_multiplier"], repeated["loss_multiplier"])
    first_asst = [next(len(m["token_ids"]) for m in log if m["role"] == "assistant") for log in legacy["message_log"]]
    assert carry["response_token_lengths"].tolist()[:G] == first_asst[:G]
    assert carry["response_token_lengths"].tolist()[G:] == [stop - start] * G  # prompt 2's first assistant: history
    assert meta.sequence_lengths == input_lengths.tolist() and meta.partition_id == "train"
    assert s.actor.policy_generation.events == ["snapshot", "finish"]


def test_keys_are_minted_once_per_prompt(setup: SimpleNamespace) -> None:
    s = setup
    repeated = prompt_batch(s.tok).repeat_interleave(G)
    meta, *_ = s.actor.rollout_to_tq(repeated, partition_id="train", group_size=G, uids=["a", "b"])
    assert meta.keys == ["a_g0", "a_g1", "a_g2", "b_g0", "b_g1", "b_g2"]
    s.driver.clear_samples(None, "train")
    meta, *_ = s.actor.rollout_to_tq(repeated, partition_id="train", group_size=G)
    uids = [k.split("_g")[0] for k in meta.keys]
    assert uids[0] == uids[2] != uids[3] == uids[5] and len(uids[0]) == 32  # uuid4 hex per prompt
    assert [k.split("_g")[1] for k in meta.keys] == ["0", "1", "2"] * 2
    for bad, match in [
        (["a"], "1 uids given for 2 prompts"),
        (["a", "a"], "must be unique"),
        (["a", ""], "non-empty strings"),
    ]:
        with pytest.raises(ValueError, match=match):
            s.actor.rollout_to_tq(repeated, partition_id="train", group_size=G, uids=bad)
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        s.actor.rollout_to_tq(repeated, partition_id="train", group_size=4)
    with pytest.raises(ValueError, match="must be repeat_interleave'd"):
        s.actor.rollout_to_tq(prompt_batch(s.tok), partition_id="train", group_size=2)
    with pytest.raises(ValueError, match="missing \\['loss_multiplier'\\]"):
        s.actor.rollout_to_tq(BatchedDataDict(message_log=repeated["message_log"]), partition_id="train")


def test_carry_keys_and_generation_lifecycle(setup: SimpleNamespace) -> None:
    s = setup
    batch = prompt_batch(s.tok)  # group_size 1, e.g. one validation batch
    engine = s.actor.policy_generation
    meta, wire, _ = s.actor.rollout_to_tq(
        batch,
        partition_id="train",
        first_iter=False,
        finish_generation=False,
        carry_keys=["total_reward", "turn_roles", "message_log", "idx"],
        greedy=True,
    )
    assert engine.events == []  # no snapshot on a later iteration, engine kept warm
    carry = decode_carry(wire)
    assert list(carry) == ["total_reward", "turn_roles", "message_log", "idx"]
    assert carry["turn_roles"][1][:3] == ["user", "assistant", "user"] and len(carry["turn_roles"][0]) == 5
    assert set(carry["message_log"][0][1]) == {"role", "content"}  # text only, no token tensors
    assert carry["idx"].tolist() == [10, 11]
    first = materialize_step(s.driver, meta)["input_ids"]
    s.driver.clear_samples(None, "train")
    meta, *_ = s.actor.rollout_to_tq(batch, partition_id="train", greedy=True)
    assert torch.equal(materialize_step(s.driver, meta)["input_ids"], first)  # greedy is passed through
    with pytest.raises(KeyError, match="not available"):
        s.actor.rollout_to_tq(batch, partition_id="train", carry_keys=["total_reward", "input_ids"])


def test_bulk_goes_to_the_store_not_through_the_driver(setup: SimpleNamespace) -> None:
    s = setup
    s.actor.rollout_to_tq(prompt_batch(s.tok).repeat_interleave(G), partition_id="train", group_size=G)
    actor_m = s.actor.data_plane_metrics()
    assert actor_m["data_plane/put/keys"] == 6 and actor_m["data_plane/put/bytes"] > 6 * 20 * (8 + 4 + 8)
    assert actor_m["data_plane/driver_bytes"] == 0 == s.driver.metrics()["data_plane/driver_bytes"]
    s.actor.shutdown()
    with pytest.raises(DataPlaneClosedError):
        s.actor.client.get_samples(["x"], "train", ["input_ids"])
    assert s.driver.bytes_held()["train"] > 0  # detaching the actor leaves the driver's store alone


def test_wire_carry_decodes_exactly_and_text_rows_limit_text(setup: SimpleNamespace) -> None:
    from relayrl.experience.carry_wire import wire_nbytes

    s = setup
    repeated = prompt_batch(s.tok).repeat_interleave(G)
    keys = ["total_reward", "loss_multiplier", "truncated", "length", "prompt_group", "loss_token_counts"]
    uids = ["a", "b"]
    _, all_text, _ = s.actor.rollout_to_tq(
        repeated, partition_id="train", group_size=G, carry_keys=keys + ["sample_text"], uids=uids, greedy=True
    )
    s.driver.clear_samples(None, "train")
    _, wire, _ = s.actor.rollout_to_tq(
        repeated,
        partition_id="train",
        group_size=G,
        carry_keys=keys + ["sample_text"],
        uids=uids,
        greedy=True,
        text_rows=2,
    )
    plain, decoded = decode_carry(all_text), decode_carry(wire)
    assert list(decoded) == keys + ["sample_text"]
    dtypes = [torch.float32, torch.float32, torch.bool, torch.int64, torch.int64, torch.int64]
    assert [decoded[k].dtype for k in keys] == dtypes  # the legacy trainer's dtypes, whatever travelled
    for k in keys:
        assert torch.equal(decoded[k], plain[k]), k
    assert decoded["sample_text"][:2] == plain["sample_text"][:2] and decoded["sample_text"][2:] == [None] * 4
    prompt, completion = plain["sample_text"][0]
    assert prompt.startswith("<|user|>") and completion  # what samples.jsonl logs for the row
    tensors = sum(plain[k].numel() * plain[k].element_size() for k in keys)
    text = sum(len(a.encode()) + len(b.encode()) for a, b in plain["sample_text"][:2])
    assert wire_nbytes(wire) - text < tensors / 2


def test_flatten_for_store_masks_like_the_matching_legacy_trainer() -> None:
    """GRPO trains on the tokens sampled in this rollout only; PPO (legacy `add_token_loss_masks(only_generated=False)`)
    on every assistant message, including one a caller's prompt already holds (no generation logprobs)."""
    from relayrl.experience.sync_rollout_actor import flatten_for_store

    def msg(role: str, ids: list[int], logprobs: list[float] | None = None) -> dict[str, Any]:
        m: dict[str, Any] = {"role": role, "content": "x", "token_ids": torch.tensor(ids)}
        if logprobs is not None:
            m["generation_logprobs"] = torch.tensor(logprobs)
        return m

    log = [msg("user", [5, 6]), msg("assistant", [7, 8]), msg("user", [9]), msg("assistant", [10, 11], [-0.5, -0.25])]
    grpo = flatten_for_store([log], pad_id=0, multiple=1)
    ppo = flatten_for_store([log], pad_id=0, multiple=1, only_generated=False)
    assert grpo["token_mask"].tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    assert ppo["token_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 1]]
    for flat in (grpo, ppo):
        assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11]]
        assert flat["generation_logprobs"].tolist() == [[0, 0, 0, 0, 0, -0.5, -0.25]]
    assert "generation_logprobs" not in log[1]  # the caller's messages are left as they were

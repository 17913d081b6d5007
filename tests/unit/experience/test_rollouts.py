"""Rollout bookkeeping with a scripted generation engine, reward routing, flattening and metric aggregation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from relayrl.environments.math_env import MathEnvironment
from relayrl.experience.rollouts import (
    add_token_loss_masks,
    aggregate_rollout_metrics,
    batched_message_log_to_flat_message,
    build_message_advantage_overrides,
    calculate_rewards,
    pop_rollout_timings,
    run_multi_turn_rollout,
)
from tests.helpers import ScriptedGenerationBase, scripted_generation_output

EOS = 1


class ScriptedEngine(ScriptedGenerationBase):
    """Answers each prompt with `reply(prompt_text, call)` -> (text, stopped); logprob of the k-th token is -0.1*(k+1)."""

    def __init__(self, tokenizer: Any, reply: Callable[[str, int], tuple[str, bool]]) -> None:
        self.tok, self.reply, self.calls = tokenizer, reply, []

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        self.calls.append({"data": data, "greedy": greedy})
        ids, lengths = data["input_ids"], data["input_lengths"]
        gens, truncs = [], []
        for row, n in zip(ids, lengths.tolist()):
            text, stopped = self.reply(self.tok.decode(row[:n].tolist()), len(self.calls))
            gens.append(self.tok(text, add_special_tokens=False)["input_ids"] + ([EOS] if stopped else []))
            truncs.append(not stopped)
        return scripted_generation_output(
            data, gens, truncs, pad_id=0, logprobs=lambda n: -0.1 * torch.arange(1, n + 1)
        )


def _prompt_batch(
    tok: Any, problems: list[str], answers: list[str], task: str = "math", **extra: Any
) -> BatchedDataDict:
    logs = []
    for p in problems:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        logs.append(
            [
                {
                    "role": "user",
                    "content": text,
                    "token_ids": torch.tensor(tok(text, add_special_tokens=False)["input_ids"]),
                }
            ]
        )
    n = len(problems)
    return BatchedDataDict(
        message_log=logs,
        length=torch.tensor([len(m[0]["token_ids"]) for m in logs]),
        extra_env_info=[{"ground_truth": a} for a in answers],
        task_name=[task] * n,
        loss_multiplier=torch.ones(n),
        idx=torch.arange(n),
        **extra,
    )


def _answer_sum(prompt: str, call: int) -> tuple[str, bool]:
    a, b = prompt.split("<|user|>")[1].split("=")[0].split("+")
    return f"\\boxed{{{int(a) + int(b)}}}", True


def test_single_turn_math_rollout(char_tokenizer) -> None:
    tok = char_tokenizer
    batch = _prompt_batch(tok, ["12+30=", "5+7="], ["42", "11"])
    engine = ScriptedEngine(tok, _answer_sum)
    out, metrics = run_multi_turn_rollout(engine, batch, tok, {"math": MathEnvironment()}, max_seq_len=64, greedy=True)

    assert engine.calls[0]["greedy"] is True
    sent = engine.calls[0]["data"]
    assert sent["input_lengths"].tolist() == [9, 7]  # "<|user|>", the problem, "<|end|>", "<|assistant|>"
    assert sent["input_ids"][1, 7:].tolist() == [0, 0]  # right-padded with <pad>
    assert out["total_reward"].tolist() == [1.0, 0.0] and out["total_reward"].dtype == torch.float32
    assert out["truncated"].tolist() == [False, False]
    assert len(batch["message_log"][0]) == 1  # input untouched

    user, asst, env = out["message_log"][0]
    assert asst["role"] == "assistant" and asst["content"] == "\\boxed{42}"
    assert asst["token_ids"].tolist() == tok("\\boxed{42}", add_special_tokens=False)["input_ids"] + [EOS]
    assert torch.allclose(asst["generation_logprobs"], -0.1 * torch.arange(1, 12, dtype=torch.float32))
    assert env == {"role": "environment", "content": "Environment: correct", "token_ids": env["token_ids"]}
    assert len(env["token_ids"]) == len("Environment: correct")
    assert out["message_log"][1][2]["content"] == "Environment: incorrect"

    assert metrics["total_turns"] == 2 and metrics["max_turns_per_sample"] == 1
    assert metrics["natural_termination_rate"] == 1.0 and metrics["truncation_rate"] == 0.0
    assert metrics["max_turns_reached_rate"] == 0.0
    assert metrics["mean_gen_tokens_per_sample"] == pytest.approx(11.0)
    assert metrics["max_gen_tokens_per_sample"] == 11
    assert metrics["mean_env_tokens_per_sample"] == pytest.approx((20 + 22) / 2)
    assert metrics["mean_total_tokens_per_sample"] == pytest.approx((9 + 11 + 20 + 7 + 11 + 22) / 2)


def test_observation_truncated_at_max_seq_len(char_tokenizer) -> None:
    tok = char_tokenizer
    batch = _prompt_batch(tok, ["12+30="] * 3, ["42"] * 3)
    env = MathEnvironment()
    # prompt 9 + answer 11 = 20 tokens; "Environment: correct" is 20 more
    out, metrics = run_multi_turn_rollout(ScriptedEngine(tok, _answer_sum), batch, tok, {"math": env}, max_seq_len=23)
    obs = out["message_log"][0][2]
    assert obs["content"] == "Environment: correct" and obs["token_ids"].tolist() == tok("Env")["input_ids"]
    assert out["truncated"].tolist() == [True] * 3
    assert out["total_reward"].tolist() == [1.0] * 3  # the reward stands; overlong filtering decides later
    assert metrics["truncation_rate"] == 1.0 and metrics["mean_env_tokens_per_sample"] == 3.0

    # landing exactly on the limit is flagged too (reference quirk), but nothing is cut
    out, _ = run_multi_turn_rollout(ScriptedEngine(tok, _answer_sum), batch, tok, {"math": env}, max_seq_len=40)
    assert out["truncated"].tolist() == [True] * 3 and len(out["message_log"][0][2]["token_ids"]) == 20
    out, _ = run_multi_turn_rollout(ScriptedEngine(tok, _answer_sum), batch, tok, {"math": env}, max_seq_len=41)
    assert out["truncated"].tolist() == [False] * 3


def test_engine_truncation_is_recorded(char_tokenizer) -> None:
    tok = char_tokenizer
    batch = _prompt_batch(tok, ["12+30=", "5+7="], ["42", "12"])
    engine = ScriptedEngine(tok, lambda p, c: ("\\boxed{4", False) if "12+" in p else ("\\boxed{12}", True))
    out, metrics = run_multi_turn_rollout(engine, batch, tok, {"math": MathEnvironment()}, max_seq_len=64)
    assert out["truncated"].tolist() == [True, False]
    assert out["message_log"][0][1]["token_ids"][-1].item() != EOS
    assert out["total_reward"].tolist() == [0.0, 1.0]
    assert metrics["truncation_rate"] == 0.5


class CountdownEnv(EnvironmentInterface):
    """Pays 0.5 per turn, ends after `metadata["turns_left"]` turns, flags replies containing '!'."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, list]] = []

    def step(self, message_log_batch, metadata):
        self.calls.append((message_log_batch, metadata))
        left = [m["turns_left"] - 1 for m in metadata]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"left {n}"} for n in left],
            metadata=[{**m, "turns_left": n} for m, n in zip(metadata, left)],
            next_stop_strings=[["STOP"] for _ in left],
            rewards=torch.full((len(left),), 0.5),
            terminateds=torch.tensor([n <= 0 for n in left]),
            message_flags=[{"is_invalid_tool_call": "!" in msgs[-1]["content"]} for msgs in message_log_batch],
        )


def test_multi_turn_accumulates_and_carries_state(char_tokenizer) -> None:
    tok = char_tokenizer
    batch = _prompt_batch(tok, ["1+1=", "2+2=", "3+3="], ["2", "4", "6"], task="countdown", stop_strings=[None] * 3)
    for info, n in zip(batch["extra_env_info"], (1, 2, 5)):
        info["turns_left"] = n
    engine = ScriptedEngine(tok, lambda p, call: ("go!" if call == 2 else "go", True))
    env = CountdownEnv()
    out, metrics = run_multi_turn_rollout(engine, batch, tok, {"countdown": env}, max_seq_len=200, max_rollout_turns=3)

    assert out["total_reward"].tolist() == [0.5, 1.0, 1.5]
    assert [len(m) for m in out["message_log"]] == [3, 5, 7]
    assert [c["data"]["input_ids"].shape[0] for c in engine.calls] == [3, 2, 1]  # finished rows drop out
    assert engine.calls[0]["data"]["stop_strings"] == [None] * 3
    assert engine.calls[1]["data"]["stop_strings"] == [["STOP"], ["STOP"]]
    # turn 2 input for row 1 = prompt + reply + observation tokens
    row1 = out["message_log"][1]
    expected = torch.cat([m["token_ids"] for m in row1[:3]])
    assert engine.calls[1]["data"]["input_ids"][0, : len(expected)].tolist() == expected.tolist()
    assert env.calls[1][0][0] == [{"role": m["role"], "content": m["content"]} for m in row1[:4]]  # role+content only
    assert out["extra_env_info"][2]["turns_left"] == 2 and batch["extra_env_info"][2]["turns_left"] == 5
    assert row1[1]["flags"] == {"is_invalid_tool_call": False}
    assert row1[3]["flags"] == {"is_invalid_tool_call": True}  # the turn-2 reply "go!"
    assert metrics["total_turns"] == 6 and metrics["max_turns_per_sample"] == 3
    assert metrics["avg_turns_per_sample"] == pytest.approx(2.0)
    assert metrics["natural_termination_rate"] == pytest.approx(2 / 3)
    assert metrics["max_turns_reached_rate"] == pytest.approx(1 / 3)


class SlowCountdownEnv(CountdownEnv):
    """A countdown whose every step takes `delay_s` (a tool call, a verifier)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def step(self, message_log_batch, metadata):
        time.sleep(self.delay_s)
        return super().step(message_log_batch, metadata)


def test_the_rollout_clocks_its_environment_apart_from_its_metrics(char_tokenizer) -> None:
    """The environment's seconds come back under `timing/` for the trainer's breakdown, and leave the metrics there."""
    tok = char_tokenizer
    batch = _prompt_batch(tok, ["1+1=", "2+2="], ["2", "4"], task="countdown", stop_strings=[None] * 2)
    for info in batch["extra_env_info"]:
        info["turns_left"] = 3
    engine = ScriptedEngine(tok, lambda p, call: ("go", True))
    start = time.perf_counter()
    _, metrics = run_multi_turn_rollout(
        engine, batch, tok, {"countdown": SlowCountdownEnv(0.02)}, max_seq_len=200, max_rollout_turns=3
    )
    elapsed = time.perf_counter() - start
    timings = pop_rollout_timings(metrics)
    assert list(timings) == ["environment"] and not any(k.startswith("timing/") for k in metrics)
    assert 3 * 0.02 <= timings["environment"] < elapsed  # three turns of one env.step each, inside the rollout
    assert metrics["total_turns"] == 6


class EchoEnv(EnvironmentInterface):
    def __init__(self, base: float) -> None:
        self.base, self.calls = base, 0

    def step(self, message_log_batch, metadata):
        self.calls += 1
        n = len(metadata)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": str(m["v"])} for m in metadata],
            metadata=metadata,
            next_stop_strings=[None] * n,
            rewards=torch.tensor([float(m["v"]) for m in metadata]),
            terminateds=torch.ones(n, dtype=torch.bool),
        )


def test_calculate_rewards_routes_by_task_and_restores_order() -> None:
    envs = {"a": EchoEnv(0), "b": EchoEnv(0)}
    logs = [[{"role": "assistant", "content": "x", "token_ids": torch.tensor([5])}]] * 6
    tasks = ["a", "b", "a", "b", "b", "b"]
    infos = [{"v": v} for v in (1, 1, 2, 2, 3, 4)]
    ret = calculate_rewards(logs, tasks, infos, envs)
    assert envs["a"].calls == 1 and envs["b"].calls == 1
    assert ret.rewards.tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 4.0]
    assert [o["content"] for o in ret.observations] == ["1", "1", "2", "2", "3", "4"]

    with pytest.raises(ValueError, match="No environment found for task type: unknown_task"):
        calculate_rewards(logs[:1], ["unknown_task"], infos[:1], envs)

    empty = calculate_rewards([], [], [], envs)
    assert envs["a"].calls == 1 and envs["b"].calls == 1
    assert empty.rewards.shape == (0,) and empty.observations == []


def test_flatten_pads_and_fills_missing_keys() -> None:
    logs = [
        [
            {"role": "user", "content": "", "token_ids": torch.tensor([7, 8, 9])},
            {
                "role": "assistant",
                "content": "",
                "token_ids": torch.tensor([4, 1]),
                "generation_logprobs": torch.tensor([-0.5, -0.25]),
            },
        ],
        [{"role": "user", "content": "", "token_ids": torch.tensor([3])}],
    ]
    flat, lengths = batched_message_log_to_flat_message(logs, {"token_ids": 0}, make_sequence_length_divisible_by=4)
    assert lengths.tolist() == [5, 1]
    assert flat["token_ids"].tolist() == [[7, 8, 9, 4, 1, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    assert flat["token_ids"].dtype == torch.long
    assert flat["generation_logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25, 0, 0, 0], [0] * 8]
    assert "token_loss_mask" not in flat

    add_token_loss_masks(logs)
    counts = build_message_advantage_overrides(logs, {"is_invalid_tool_call": -5.0})
    assert counts == {"is_invalid_tool_call": 0}
    flat, _ = batched_message_log_to_flat_message(logs, {"token_ids": 0})
    assert flat["token_loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]
    assert torch.isnan(flat["advantage_override"]).all()

    with pytest.raises(ValueError, match="row 1 message 0: generation_logprobs has shape"):
        bad = [
            [
                {
                    "role": "assistant",
                    "content": "",
                    "token_ids": torch.tensor([1]),
                    "generation_logprobs": torch.zeros(2),
                }
            ]
        ]
        batched_message_log_to_flat_message([[]] + bad, {})


def test_token_loss_masks_only_generated() -> None:
    def logs() -> list:
        return [
            [
                {"role": "system", "content": "", "token_ids": torch.tensor([1, 2])},
                {"role": "assistant", "content": "", "token_ids": torch.tensor([3])},  # few-shot, not sampled
                {
                    "role": "assistant",
                    "content": "",
                    "token_ids": torch.tensor([4, 5]),
                    "generation_logprobs": torch.zeros(2),
                },
                {"role": "environment", "content": "", "token_ids": torch.tensor([6])},
            ]
        ]

    masked = add_token_loss_masks(logs())
    assert [m["token_loss_mask"].tolist() for m in masked[0]] == [[0, 0], [0], [1, 1], [0]]
    assert masked[0][1]["generation_logprobs"].tolist() == [0.0]
    masked = add_token_loss_masks(logs(), only_generated=False)
    assert [m["token_loss_mask"].tolist() for m in masked[0]] == [[0, 0], [1], [1, 1], [0]]


def test_message_advantage_overrides() -> None:
    flags_order = {"is_invalid_tool_call": -5.0, "has_malformed_thinking": -7.0}
    logs = [
        [
            {"role": "user", "content": "", "token_ids": torch.tensor([1]), "flags": {"is_invalid_tool_call": True}},
            {
                "role": "assistant",
                "content": "",
                "token_ids": torch.tensor([2, 3]),
                "flags": {"has_malformed_thinking": True},
            },
            {
                "role": "assistant",
                "content": "",
                "token_ids": torch.tensor([4]),
                "flags": {"has_malformed_thinking": True, "is_invalid_tool_call": True},
            },
            {
                "role": "assistant",
                "content": "",
                "token_ids": torch.tensor([5]),
                "flags": {"is_invalid_tool_call": False},
            },
        ]
    ]
    counts = build_message_advantage_overrides(logs, flags_order)
    assert counts == {"is_invalid_tool_call": 1, "has_malformed_thinking": 1}
    flat, _ = batched_message_log_to_flat_message(logs, {})
    got = flat["advantage_override"][0].tolist()
    assert math.isnan(got[0]) and got[1:4] == [-7.0, -7.0, -5.0] and math.isnan(got[4])


def test_tool_call_validity_is_pooled_over_batches_not_a_mean_of_ratios() -> None:
    """Batch 1: 1 valid call of 4 (0.25); batch 2: 6 of 6 (1.0). Pooled: 7 of 10, where a mean of ratios says 0.625."""
    agg = aggregate_rollout_metrics(
        [
            {"env/tool_calls": 1.0, "env/invalid_tool_calls": 3.0, "env/tool_call_validity": 0.25},
            {"env/tool_calls": 6.0, "env/invalid_tool_calls": 0.0, "env/tool_call_validity": 1.0},
        ]
    )
    assert agg["env/tool_call_validity"] == pytest.approx(0.7)
    assert agg["env/tool_calls"] == 3.5 and agg["env/invalid_tool_calls"] == 1.5  # counters: means per batch


def test_aggregate_rollout_metrics() -> None:
    agg = aggregate_rollout_metrics(
        [
            {
                "total_turns": 4,
                "truncation_rate": 0.5,
                "max_gen_tokens_per_sample": 10,
                "min_len": 3,
                "reward/max": 1.0,
                "reward/min": 0.0,
                "mean_gen_tokens_per_sample": 4.0,
                "note": "a",
            },
            {
                "total_turns": 6,
                "truncation_rate": 0.0,
                "max_gen_tokens_per_sample": 7,
                "min_len": 2,
                "reward/max": 0.5,
                "reward/min": -1.0,
                "mean_gen_tokens_per_sample": 8.0,
                "note": "b",
            },
        ]
    )
    assert agg == {
        "total_turns": 10,
        "truncation_rate": 0.25,
        "max_gen_tokens_per_sample": 10,
        "min_len": 2,
        "reward/max": 1.0,
        "reward/min": -1.0,
        "mean_gen_tokens_per_sample": 6.0,
        "note": "b",
    }
    assert aggregate_rollout_metrics([]) == {}


def test_aggregate_rollout_metrics_averages_rates_named_min_or_max() -> None:
    """`max_turns_reached_rate` is a share of rows: two batches at 1.0 and 0.0 reached the limit on half their rows."""
    agg = aggregate_rollout_metrics(
        [
            {"max_turns_reached_rate": 1.0, "min_reward_rate": 0.2},
            {"max_turns_reached_rate": 0.0, "min_reward_rate": 0.6},
        ]
    )
    assert agg == {"max_turns_reached_rate": 0.5, "min_reward_rate": pytest.approx(0.4)}


def test_trim_to_last_loss_token_cuts_trailing_non_loss_tokens():
    from relayrl.distributed.batched_data_dict import BatchedDataDict
    from relayrl.experience.rollouts import trim_to_last_loss_token

    flat = BatchedDataDict(
        token_ids=torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0], [4, 4, 4, 4, 4, 4]]),
        token_loss_mask=torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]),
        generation_logprobs=torch.tensor([[0.0, -1.0, -2.0, 0.0, 0.0, 0.0]] * 3),
    )
    out, lengths = trim_to_last_loss_token(flat, torch.tensor([5, 3, 6]), pad_value_dict={"token_ids": 0})
    assert lengths.tolist() == [3, 3, 6]  # a row without loss tokens keeps its length
    assert out["token_ids"].tolist() == [[5, 6, 7, 0, 0, 0], [5, 6, 7, 0, 0, 0], [4, 4, 4, 4, 4, 4]]
    out2, lengths2 = trim_to_last_loss_token(flat.select_indices([0, 1]), torch.tensor([5, 3]), {"token_ids": 0}, 4)
    assert lengths2.tolist() == [3, 3] and out2["token_ids"].shape == (2, 4)
    assert out2["generation_logprobs"][0].tolist() == [0.0, -1.0, -2.0, 0.0]

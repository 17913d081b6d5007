"""MathEnvironment: math-verify scoring, counted failures, batch metrics, and the registry."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relayrl.config import EnvConfig, MasterConfig, MathEnvConfig
from relayrl.environments.math_env import MathEnvironment, extract_boxed, verify_answer
from relayrl.environments.registry import build_environments, create_env, create_task_to_env, register_env


def _log(*assistant: str) -> list[dict]:
    return [{"role": "user", "content": "37+45="}, *({"role": "assistant", "content": a} for a in assistant)]


def _step(env: MathEnvironment, responses: list[str], truths: list[str]):
    return env.step([_log(r) for r in responses], [{"ground_truth": g} for g in truths])


@pytest.fixture(scope="module")
def env():
    env = MathEnvironment(MathEnvConfig())
    yield env
    env.shutdown()


def test_scores_correct_wrong_malformed_and_unboxed(env: MathEnvironment) -> None:
    out = _step(
        env,
        ["\\boxed{82}", "\\boxed{81}", "\\boxed{82", "82", "\\boxed{-33}", "\\boxed{33}", "\\boxed{\\frac{1}{2}}"],
        ["82", "82", "82", "82", "-33", "-33", "0.5"],
    )
    assert out.rewards.dtype == torch.float32
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert out.terminateds.tolist() == [True] * 7
    assert out.next_stop_strings == [None] * 7
    assert out.answers == ["82", "81", None, None, "-33", "33", "\\frac{1}{2}"]
    assert [o["content"] for o in out.observations[:2]] == ["Environment: correct", "Environment: incorrect"]
    assert all(o["role"] == "environment" for o in out.observations)
    assert env.last_metrics == {"num_verify_errors": 0, "num_verify_timeouts": 0, "num_verify_over_budget": 0}


def test_response_is_all_assistant_messages_concatenated(env: MathEnvironment) -> None:
    meta = [{"ground_truth": "82", "extra": 1}]
    out = env.step([_log("I think \\boxed{", "82}")], meta)
    assert out.rewards.tolist() == [1.0]
    assert out.metadata == meta  # unchanged


def test_extract_boxed_takes_last_complete_box() -> None:
    assert extract_boxed("\\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert extract_boxed("\\boxed{5} and \\boxed{6") == "5"
    assert extract_boxed("no box") is None


def test_integer_fast_path_matches_math_verify(env: MathEnvironment) -> None:
    pairs = [("82", "82"), ("82", "082"), ("-5", "5"), ("0", "-0"), ("-33", "-33"), ("100", "10"), ("7", " 7 ")]
    fast, _, _ = env.score_batch([f"\\boxed{{{p}}}" for _, p in pairs], [g for g, _ in pairs])
    assert fast == [verify_answer(g, p) for g, p in pairs] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_verify_exception_scores_zero_and_is_counted(env: MathEnvironment) -> None:
    env.global_post_process_and_metrics({"total_reward": torch.zeros(0), "message_log": []})  # reset counts
    out = _step(env, ["\\boxed{x+1}", "\\boxed{7}"], ["1/0", "7"])  # sympy cannot compare against zoo
    assert out.rewards.tolist() == [0.0, 1.0]
    assert env.last_metrics == {"num_verify_errors": 1, "num_verify_timeouts": 0, "num_verify_over_budget": 0}
    _, metrics = env.global_post_process_and_metrics(
        {"total_reward": out.rewards, "message_log": [_log("a"), _log("b")]}
    )
    assert metrics["num_verify_errors"] == 1
    _, metrics = env.global_post_process_and_metrics({"total_reward": out.rewards, "message_log": [_log("a")] * 2})
    assert metrics["num_verify_errors"] == 0  # reported once, then reset


@pytest.fixture(scope="module")
def quick_env():
    env = MathEnvironment(MathEnvConfig(timeout_s=0.5))
    yield env
    env.shutdown()


def _timeout_case(env: MathEnvironment) -> tuple[list[float], float]:
    env.step([_log("\\boxed{1/2}")], [{"ground_truth": "0.5"}])  # start the verifier process outside the clock
    start = time.perf_counter()
    # sympy would run for ever on the first; the third must still be verified afterwards (by a fresh process)
    responses = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{4}", "\\boxed{\\frac{1}{4}}"]
    out = _step(env, responses, ["42", "4", "0.25"])
    return out.rewards.tolist(), time.perf_counter() - start


def test_timeout_is_bounded_and_counted(quick_env: MathEnvironment) -> None:
    rewards, elapsed = _timeout_case(quick_env)
    assert rewards == [0.0, 1.0, 1.0]
    assert quick_env.last_metrics == {"num_verify_errors": 0, "num_verify_timeouts": 1, "num_verify_over_budget": 0}
    assert elapsed < 30.0  # 0.5 s time-out plus one verifier restart on a busy machine


def test_timeout_from_a_worker_thread_is_bounded_and_counted(quick_env: MathEnvironment) -> None:
    box: list = []
    worker = threading.Thread(target=lambda: box.append(_timeout_case(quick_env)), daemon=True)
    worker.start()
    worker.join(60)
    assert box, "step hung in a worker thread"
    assert box[0][0] == [0.0, 1.0, 1.0]
    assert quick_env.last_metrics["num_verify_timeouts"] == 1


def test_a_batch_past_its_time_budget_scores_the_rest_0_and_counts_them(monkeypatch, caplog) -> None:
    """Every verification made artificially slow (0.4 s, well under the 5 s per-answer time-out): with a budget of
    1 s per batch, the first answers are verified, the batch stops within about the budget, and the answers it
    never tried score 0, are counted in num_verify_over_budget and named in one warning line."""
    from relayrl.environments import math_env

    slow_loop = math_env._WORKER_LOOP.replace("    try:\n", "    import time; time.sleep(0.4)\n    try:\n", 1)
    assert slow_loop != math_env._WORKER_LOOP
    monkeypatch.setattr(math_env, "_WORKER_LOOP", slow_loop)
    env = MathEnvironment(MathEnvConfig(timeout_s=5.0, batch_timeout_s=1.0))
    try:
        env.step([_log("\\boxed{\\frac{1}{2}}")], [{"ground_truth": "0.5"}])  # start the worker off the clock
        n = 12
        responses = [f"\\boxed{{\\frac{{{k}}}{{7}}}}" for k in range(1, n + 1)]  # distinct, all correct
        start = time.perf_counter()
        with caplog.at_level("WARNING", logger=math_env.__name__):
            out = _step(env, responses, [f"{k}/7" for k in range(1, n + 1)])
        elapsed = time.perf_counter() - start
        rewards = out.rewards.tolist()
        counts = env.last_metrics
        verified = sum(r == 1.0 for r in rewards)
        assert counts["num_verify_over_budget"] >= n - 3 and verified + counts["num_verify_over_budget"] == n
        assert counts["num_verify_timeouts"] == counts["num_verify_errors"] == 0
        assert rewards[:verified] == [1.0] * verified and rewards[verified:] == [0.0] * (n - verified)
        assert elapsed < 10.0  # ~1 s budget (+ one child kill); verifying all 12 would take ~5 s
        budget_lines = [r.getMessage() for r in caplog.records if "budget" in r.getMessage()]
        assert budget_lines == [
            f"math-verify spent the batch budget of 1.0s; scoring {n - verified} unverified answers 0"
        ]
        _, metrics = env.global_post_process_and_metrics(
            {"rewards": out.rewards, "message_log": [_log(r) for r in responses]}
        )
        assert metrics["num_verify_over_budget"] == n - verified
        # a budget running out during the batch's last answer still scores every row
        out = _step(
            env, ["\\boxed{\\frac{1}{9}}", "\\boxed{\\frac{2}{9}}", "\\boxed{\\frac{4}{9}}"], ["1/9", "2/9", "4/9"]
        )
        assert len(out.rewards) == 3 and env.last_metrics["num_verify_over_budget"] >= 1
        assert sum(out.rewards.tolist()) + env.last_metrics["num_verify_over_budget"] == 3
    finally:
        env.shutdown()


def test_128_answers_verify_in_milliseconds(env: MathEnvironment) -> None:
    truths = [str(v) for v in range(-64, 64)]
    responses = [f"\\boxed{{{v if v % 3 else v + 1}}}" for v in range(-64, 64)]
    _step(env, responses[:2], truths[:2])  # warm the import
    start = time.perf_counter()
    out = _step(env, responses, truths)
    assert time.perf_counter() - start < 0.25
    assert out.rewards.sum().item() == sum(1 for v in range(-64, 64) if v % 3)


def test_missing_ground_truth_is_an_error(env: MathEnvironment) -> None:
    with pytest.raises(ValueError, match="row 1: metadata has no 'ground_truth'"):
        env.step([_log("\\boxed{1}")] * 2, [{"ground_truth": "1"}, {}])


def test_global_post_process_metrics(env: MathEnvironment) -> None:
    def log(n_gen: int) -> list[dict]:
        return [
            {"role": "user", "content": "p", "token_ids": torch.zeros(3)},
            {"role": "assistant", "content": "a", "token_ids": torch.zeros(n_gen)},
            {"role": "environment", "content": "e", "token_ids": torch.zeros(5)},
        ]

    batch = {
        "total_reward": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "truncated": torch.tensor([False, False, True, False]),
        "length": torch.tensor([3, 3, 5, 5]),
        "idx": torch.tensor([0, 0, 1, 1]),
        "message_log": [log(2), log(4), log(6), log(8)],
    }
    batch, m = env.global_post_process_and_metrics(batch)
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.0, 0.0]  # truncated row's reward zeroed
    assert m["accuracy"] == pytest.approx(0.25)
    assert m["pass@samples_per_prompt"] == pytest.approx(0.5)
    assert m["fraction_of_samples_properly_ended"] == pytest.approx(0.75)
    assert m["num_problems_in_batch"] == 4
    assert m["generation_lengths"] == pytest.approx(5.0)
    assert m["prompt_lengths"] == pytest.approx(4.0)
    assert m["correct_solution_generation_lengths"] == pytest.approx(2.0)


def test_registry_builds_math_and_rejects_unknown() -> None:
    env = create_env("math", EnvConfig(math=MathEnvConfig(timeout_s=2.0)))
    assert isinstance(env, MathEnvironment) and env.cfg.timeout_s == 2.0
    task_to_env = create_task_to_env(["math", "math"])
    assert list(task_to_env) == ["math"]
    with pytest.raises(ValueError, match="unknown environment 'code'; registered: math"):
        create_env("code")
    envs = build_environments(MasterConfig(), task_names=["math"])
    assert list(envs) == ["math"] and isinstance(envs["math"], MathEnvironment)
    with pytest.raises(ValueError, match="unknown environment 'other'"):
        build_environments(MasterConfig(), task_names=["other"])
    with pytest.raises(ValueError, match="already registered"):
        register_env("math", lambda cfg: MathEnvironment(cfg.math))


def test_the_environments_of_a_process_share_one_verifier_child() -> None:
    """Train and validation environments, and the next run's, talk to one child (each new one costs a second of CPU
    importing sympy); an environment's shutdown leaves it to the next."""
    first, second = MathEnvironment(MathEnvConfig()), MathEnvironment(MathEnvConfig())
    assert first._verifier is second._verifier
    assert _step(first, ["\\boxed{\\frac{1}{2}}"], ["0.5"]).rewards.tolist() == [1.0]
    child = first._verifier._proc
    assert child is not None and child.poll() is None
    first.shutdown()
    assert _step(second, ["\\boxed{0.25}"], ["1/4"]).rewards.tolist() == [1.0]
    assert second._verifier._proc is child and child.poll() is None

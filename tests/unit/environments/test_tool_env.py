"""Environment classes (TRL's environment_factory contract): tool schemas, the hermes parser, concurrent tool calls
with deadlines, episodes (reset, tools, get_reward, reward functions with environments=) and one-line errors."""

from __future__ import annotations

import asyncio
import time

import pytest

from relayrl.environments.reward_fn_env import RewardFunctionEnvironment
from relayrl.environments.tool_calls import ToolJob, parse_hermes, run_calls, tool_schemas
from relayrl.environments.tool_env import EnvironmentClassError, ToolEnvironment


class Calculator:
    """Adds numbers; async and slow tools too."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.target = 0

    def reset(self, target: int, **row: object) -> str | None:
        self.target = int(target)
        return None if target != 13 else "Thirteen."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first addend
            b: second addend
        """
        self.calls.append("add")
        return a + b

    async def wait(self, seconds: float) -> str:
        """Sleep, without blocking a thread's event loop.

        Args:
            seconds: how long
        """
        await asyncio.sleep(seconds)
        self.calls.append("wait")
        return f"waited {seconds}"

    def hang(self, seconds: float) -> str:
        """Block the calling thread.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "late"

    def explode(self) -> str:
        """Always fails."""
        raise KeyError("no such key")

    def get_reward(self) -> float:
        return float(self.target in (len(self.calls), 99))

    def _private(self) -> None:  # not a tool
        pass


def test_public_documented_methods_are_tools_with_json_schemas() -> None:
    schemas = tool_schemas(Calculator)
    assert sorted(schemas) == ["add", "explode", "hang", "wait"]  # not reset, get_reward or _private
    add = schemas["add"]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "first addend"}
    assert add["parameters"]["required"] == ["a", "b"]

    class Undocumented:
        def peek(self, x: int) -> int:
            return x

    with pytest.raises(ValueError, match=r"Undocumented\.peek is a public method.*make it private \(_peek\)"):
        tool_schemas(Undocumented)


def test_hermes_parser_reads_calls_and_refuses_malformed_ones() -> None:
    text = 'a<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> b <tool_call>\n{"name": "explode"}\n</tool_call>'
    assert parse_hermes(text) == [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "explode", "arguments": {}}]
    assert parse_hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')[0]["arguments"] == {
        "a": 1
    }
    assert parse_hermes("no call here") == []
    for bad, why in [
        ('<tool_call>{"name": "add"}', "unbalanced"),
        ("<tool_call>{oops}</tool_call>", "not valid JSON"),
        ('<tool_call>["add"]</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_hermes(bad)


def test_calls_run_concurrently_async_awaited_and_a_hung_tool_costs_its_deadline() -> None:
    envs = [Calculator() for _ in range(3)]
    jobs = [
        [ToolJob(envs[0], "wait", {"seconds": 0.4}), ToolJob(envs[0], "add", {"a": 2, "b": 3})],  # in order
        [ToolJob(envs[1], "hang", {"seconds": 5.0})],
        [ToolJob(envs[2], "wait", {"seconds": 0.4}), ToolJob(envs[2], "explode", {})],
    ]
    start = time.monotonic()
    results = run_calls(jobs, timeout_s=0.8)
    elapsed = time.monotonic() - start
    # round 1 runs the two 0.4 s waits and the hung call side by side and stops waiting at the 0.8 s deadline;
    # round 2 (add, explode) is instant: far below the 5.8 s of running them one after another
    assert 0.75 < elapsed < 2.0, elapsed
    assert [r.status for r in results[0]] == ["ok", "ok"] and [r.text for r in results[0]] == ["waited 0.4", "5"]
    assert envs[0].calls == ["wait", "add"]
    assert results[1][0].status == "timeout" and results[1][0].text == "Error: tool 'hang' timed out after 0.8 s"
    assert results[1][0].latency_s == 0.8
    assert results[2][1].status == "error" and results[2][1].text == "Error: KeyError: 'no such key'"


def _episode_rows(targets: list[int]) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"make {t}"}], "columns": {"target": t, "id": k}, "row": k + 1}
        for k, t in enumerate(targets)
    ]


def _reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "p"}, {"role": "assistant", "content": text}]


def test_episode_reset_tools_errors_counts_and_rewards() -> None:
    seen = {}

    def used_tools(prompts, completions, environments, target, **columns):
        seen["envs"] = environments
        return [float(len(e.calls)) for e in environments]

    env = ToolEnvironment(Calculator, reward_fns=RewardFunctionEnvironment([used_tools], [0.5]), tool_timeout_s=5)
    starts = env.start_episodes(_episode_rows([13, 1, 99]))
    assert starts[0].messages == [{"role": "user", "content": "make 13\n\nThirteen."}]  # reset's text appended
    assert starts[1].messages == [{"role": "user", "content": "make 1"}]
    assert [t["function"]["name"] for t in starts[0].tools] == ["add", "explode", "hang", "wait"]
    metas = [s.metadata for s in starts]
    ret = env.step(
        [
            _reply('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'),
            _reply('<tool_call>{"name": "explode"}</tool_call><tool_call>{"name": "nope"}</tool_call>'),
            _reply("42"),
        ],
        metas,
    )
    assert ret.terminateds.tolist() == [False, False, True]
    assert ret.observations[0]["chat"] == [{"role": "tool", "name": "add", "content": "3"}]
    assert ret.observations[1]["chat"][0]["content"].startswith("Error: unknown tool 'nope'")
    assert ret.message_flags[1] == {"is_invalid_tool_call": True}  # the call of an unknown tool: none run
    assert ret.rewards.tolist() == [0.0, 0.0, 1.0]  # row 2 ended: get_reward (target 99) + 0.5 * 0 tools used
    assert ret.metadata[2]["reward_components"] == {"get_reward": 1.0, "used_tools": 0.0}
    assert "episode" not in ret.metadata[2] and "episode" in ret.metadata[0]  # the id leaves with the episode
    ret2 = env.step([_reply('<tool_call>{"name": "explode"}</tool_call>'), _reply("")], ret.metadata[:2])
    assert "Error: KeyError" in ret2.observations[0]["chat"][0]["content"] and ret2.terminateds.tolist() == [
        False,
        True,
    ]
    end = env.end_episodes([_reply("")], [ret2.metadata[0]])  # the rollout stopped row 0 (turn limit)
    assert end.rewards.tolist() == [pytest.approx(0.5)]  # 13 != 1 tool call; 0.5 * 1
    assert [e.calls for e in seen["envs"]] == [["add"]]
    metrics = env.rollout_metrics()
    assert metrics["env/tool_calls"] == 2 and metrics["env/tool_errors"] == 1
    assert metrics["env/invalid_tool_calls"] == 1 and metrics["env/episodes"] == 3
    assert metrics["env/tool_call_validity"] == pytest.approx(2 / 3)  # 2 calls parsed of 3 the model made
    after = env.rollout_metrics()  # reset: no call since, so no validity (never a made-up 0 or 1)
    assert "reward/used_tools" in metrics and after["env/tool_calls"] == 0 and "env/tool_call_validity" not in after
    assert not env._episodes


class BrokenReset(Calculator):
    def reset(self, target: int, **row: object) -> str | None:
        if target == 7:
            raise RuntimeError("cannot start\nsecond line")
        return None


class BrokenReward(Calculator):
    def get_reward(self) -> float:
        raise ZeroDivisionError("division by zero")


def test_reset_and_get_reward_failures_end_the_run_with_one_line_naming_class_and_row() -> None:
    with pytest.raises(EnvironmentClassError) as info:
        ToolEnvironment(BrokenReset).start_episodes(_episode_rows([1, 7]))
    assert str(info.value) == "environment class BrokenReset.reset failed on dataset row 2: RuntimeError: cannot start"
    env = ToolEnvironment(BrokenReward)
    metas = [s.metadata for s in env.start_episodes(_episode_rows([3]))]
    with pytest.raises(
        EnvironmentClassError, match=r"^environment class BrokenReward.get_reward failed on dataset row 1"
    ):
        env.step([_reply("done")], metas)


def test_a_parser_that_breaks_ends_the_run_in_one_line_and_a_malformed_call_is_counted() -> None:
    """A parser's ValueError is the model's malformed call (counted, answered with the error); any other exception
    is a bug in the user's parser: one line naming it and the row, as for the class's own methods."""

    def strict(reply: str) -> list:
        if reply == "garbled":
            raise ValueError("not a call")
        return {"calls": []}["call"]  # KeyError: the parser's own bug

    env = ToolEnvironment(Calculator, parser=strict)
    metas = [s.metadata for s in env.start_episodes(_episode_rows([3, 4]))]
    with pytest.raises(EnvironmentClassError) as info:
        env.step([_reply("garbled"), _reply("fine")], metas)
    assert str(info.value) == (
        "tool-call parser 'test_a_parser_that_breaks_ends_the_run_in_one_line_and_a_malformed_call_is_counted."
        "<locals>.strict' failed on dataset row 2: KeyError: 'call' (env.tool_call_parser; raise ValueError for a "
        "malformed call)"
    )
    assert env.rollout_metrics()["env/invalid_tool_calls"] == 1  # the first row's garbled reply, before it


class Closing(Calculator):
    closed: list[int] = []

    def close(self) -> None:
        Closing.closed.append(self.target)


def test_an_instance_whose_reset_failed_is_closed_and_shutdown_closes_open_episodes() -> None:
    class FailingReset(Closing):
        def reset(self, target: int, **row: object) -> str | None:
            self.target = int(target)
            if target == 7:
                raise RuntimeError("cannot start")
            return None

    Closing.closed = []
    env = ToolEnvironment(FailingReset)
    with pytest.raises(EnvironmentClassError, match="FailingReset.reset failed on dataset row 3"):
        env.start_episodes(_episode_rows([1, 2, 7, 8]))
    assert Closing.closed == [7]  # the served session it may have opened is released; row 4 was never made
    env.shutdown()  # the run ends: the episodes it started are closed too
    assert sorted(Closing.closed) == [1, 2, 7]


def test_a_fork_keeps_episodes_and_counters_of_its_own_and_shares_the_reward_functions_copy() -> None:
    """The async producer's copy (`fork_environments`): counts of one side's rollouts never reach the other's
    metrics; two classes sharing reward functions share one copy of them, as they share the original."""
    from relayrl.environments.registry import fork_environments

    def used(prompts, completions, environments, **columns):
        return [float(len(e.calls)) for e in environments]

    scorer = RewardFunctionEnvironment([used])
    envs = {"a": ToolEnvironment(Calculator, reward_fns=scorer), "b": ToolEnvironment(Closing, reward_fns=scorer)}
    envs["reward_fns"] = scorer
    forks = fork_environments(envs)
    assert all(forks[t] is not envs[t] for t in envs)
    assert forks["a"].reward_fns is forks["b"].reward_fns is forks["reward_fns"]
    assert forks["a"].factory is Calculator and forks["a"].schemas == envs["a"].schemas
    metas = [s.metadata for s in forks["a"].start_episodes(_episode_rows([99]))]
    ret = forks["a"].step([_reply('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')], metas)
    forks["a"].step([_reply("3")], ret.metadata)
    assert not envs["a"]._episodes and envs["a"].rollout_metrics()["env/tool_calls"] == 0
    assert "reward/used" not in envs["a"].rollout_metrics()
    mine = forks["a"].rollout_metrics()
    assert mine["env/tool_calls"] == 1 and mine["env/episodes"] == 1 and mine["reward/used"] == 1.0


def test_an_environment_pickles_for_a_ray_actor_and_a_file_class_loads_again_elsewhere(tmp_path, monkeypatch) -> None:
    """What a Ray rollout actor receives: the settings and the class (a `file.py:Class` entry: its absolute path,
    loaded again in the receiving process, whatever its directory), never live episodes."""
    import pickle

    from relayrl.config import MasterConfig
    from relayrl.environments.registry import build_tool_environments

    (tmp_path / "envs.py").write_text("class Echo:\n    def reset(self, **row):\n        return 'hi'\n")
    monkeypatch.chdir(tmp_path)
    cfg = MasterConfig(env={"environment_factory": "envs.py:Echo", "tool_timeout_s": 7})
    env = build_tool_environments(cfg)["environment"]
    payload = pickle.dumps(env)
    (tmp_path / "envs.py").write_text("class Echo:\n    def reset(self, **row):\n        return 'again'\n")
    monkeypatch.chdir("/")  # the actor's directory is not the driver's
    there = pickle.loads(payload)
    assert there.factory is not env.factory and there.tool_timeout_s == 7 and there.name == "Echo"
    assert there.start_episodes([{"prompt": "p"}])[0].messages[0]["content"] == "p\n\nagain"  # the file, loaded there
    given = pickle.loads(pickle.dumps(ToolEnvironment(Calculator, tool_timeout_s=3)))  # a class: sent as it is
    assert given.factory is Calculator and set(given.schemas) == set(ToolEnvironment(Calculator).schemas)
    env.start_episodes([{"prompt": "p"}])
    with pytest.raises(TypeError, match="environment class Echo has live episodes"):
        pickle.dumps(env)

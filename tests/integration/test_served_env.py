"""A served environment (issue 26 item 4): a real OpenEnv server on loopback, started by this module with the
`openenv` package's server API (uvicorn in a thread), played through the package's client by the adapter.

The server's environment is a guessing game: `reset(answer=...)` hides the row's answer, each `step` with a
`Guess(value=...)` answers `correct` (reward 1, done) or `wrong`. A guess `slow` makes the server sleep past the
client's deadline. What is asserted: the observation texts become the first prompt and the tool messages, the
server's reward and done end the episode with its reward, and a server that times out or is gone ends the run with
one line (`env.on_server_error=fail`) or the episode with a counted failure (`count`), leaving no session open; and
asynchronous GRPO plays it as the synchronous trainer does.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("openenv")

import uvicorn  # noqa: E402
from openenv.core.env_server.http_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from relayrl.cli.main import main  # noqa: E402
from relayrl.environments.openenv_env import openenv_environment  # noqa: E402
from relayrl.environments.tool_calls import parse_hermes  # noqa: E402
from relayrl.environments.tool_env import ServedEnvironmentError, ToolEnvironment  # noqa: E402
from tests.helpers import metrics_by_step  # noqa: E402


class Guess(Action):
    """Guess the hidden number."""

    value: str


class Feedback(Observation):
    text: str = ""


class GuessGame(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    sessions: set[int] = set()  # ids of the games of sessions still open (the server closes a game with its session)

    def __init__(self, intro: str = "Guess the number.") -> None:
        super().__init__()
        self.intro = intro
        self._state = State(episode_id="none", step_count=0)
        self.target = ""
        GuessGame.sessions.add(id(self))

    def reset(self, seed=None, episode_id=None, answer="", **kwargs) -> Feedback:  # noqa: ANN001
        if answer == "refuse":
            raise RuntimeError("no such game")
        self.target, self._state = str(answer), State(episode_id=episode_id or "episode", step_count=0)
        return Feedback(text=self.intro, reward=0.0)

    def close(self) -> None:
        GuessGame.sessions.discard(id(self))

    def step(self, action: Guess, timeout_s=None, **kwargs) -> Feedback:  # noqa: ANN001
        self._state.step_count += 1
        if action.value == "slow":
            time.sleep(1.0)
        right = action.value == self.target
        return Feedback(text="correct" if right else "wrong", done=right, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


class Served:
    """An OpenEnv server on a free loopback port, in a thread of this process; `stop()` takes it down."""

    def __init__(self, intro: str = "Guess the number.") -> None:
        app = create_app(lambda: GuessGame(intro), Guess, Feedback, env_name="guess", max_concurrent_envs=16)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the OpenEnv server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = Served()
    yield served
    served.stop()


def _env(url: str, on_server_error: str = "fail", timeout_s: float = 5.0) -> ToolEnvironment:
    cls = openenv_environment(url, Guess, reset_columns=["answer"], timeout_s=timeout_s)
    return ToolEnvironment(cls, parser=parse_hermes, tool_timeout_s=10.0, on_server_error=on_server_error)


def _call(value: str) -> list[dict]:
    return [
        {
            "role": "assistant",
            "content": f'<tool_call>{{"name": "step", "arguments": {{"value": "{value}"}}}}</tool_call>',
        }
    ]


def _rows(*answers: str) -> list[dict]:
    return [{"row": k, "prompt": "Find it.", "columns": {"answer": a}} for k, a in enumerate(answers)]


def test_reset_and_steps_of_a_served_episode(server) -> None:
    env = _env(server.url)
    starts = env.start_episodes(_rows("4", "9"))
    assert [s.messages[0]["content"] for s in starts] == ["Find it.\n\nGuess the number."] * 2  # reset's text
    (tool,) = starts[0].tools
    assert tool["function"]["name"] == "step" and tool["function"]["description"] == "Guess the hidden number."
    assert tool["function"]["parameters"]["required"] == ["value"]  # the Action's fields, less metadata
    metas = [s.metadata for s in starts]
    ret = env.step([_call("3"), _call("9")], metas)  # row 0 wrong, row 1 right: the server says done
    assert [o["chat"] for o in ret.observations] == [
        [{"role": "tool", "name": "step", "content": "wrong"}],
        [{"role": "tool", "name": "step", "content": "correct"}],
    ]
    assert ret.terminateds.tolist() == [False, True] and ret.rewards.tolist() == [0.0, 1.0]
    live = env._episode(ret.metadata[0]).env  # what reward functions get as environments=: the server's state
    assert live.server_state()["step_count"] == 1
    bad = [{"role": "assistant", "content": '<tool_call>{"name": "step", "arguments": {"guess": "4"}}</tool_call>'}]
    ret2 = env.step([bad], [ret.metadata[0]])  # an argument the Action refuses: the model's error, told to it
    assert ret2.observations[0]["chat"][0]["content"].startswith("Error: ValueError: invalid arguments for 'step'")
    ret3 = env.step([[{"role": "assistant", "content": "4"}]], [ret2.metadata[0]])  # no call: the episode ends
    assert ret3.terminateds.tolist() == [True] and ret3.rewards.tolist() == [0.0]
    metrics = env.rollout_metrics()
    assert (metrics["env/episodes"], metrics["env/tool_calls"], metrics["env/tool_errors"]) == (2, 3, 1)
    assert metrics["env/server_errors"] == 0 and not env._episodes  # every episode ended and closed


def test_a_server_past_its_timeout_fails_the_run_or_the_episode(server) -> None:
    env = _env(server.url, timeout_s=0.3)
    metas = [s.metadata for s in env.start_episodes(_rows("4"))]
    with pytest.raises(ServedEnvironmentError) as err:
        env.step([_call("slow")], metas)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"served environment {server.url} failed on dataset row 0: step")
    assert "TimeoutError" in line and "env.on_server_error=count" in line
    env.shutdown()
    counted = _env(server.url, on_server_error="count", timeout_s=0.3)
    metas = [s.metadata for s in counted.start_episodes(_rows("4", "5"))]
    ret = counted.step([_call("slow"), _call("5")], metas)
    assert ret.terminateds.tolist() == [True, True] and ret.rewards.tolist() == [0.0, 1.0]
    assert ret.metadata[0]["server_error"].startswith("step failed: TimeoutError")
    assert "server_error" not in ret.metadata[1]
    assert counted.rollout_metrics()["env/server_errors"] == 1


def test_a_failing_reset_ends_the_run_and_leaves_no_session_open(server) -> None:
    """The server refuses row 1's reset: the run ends with one line, the session that reset opened is closed at
    once, and the one of row 0 (its episode still open) when the environment shuts down, as the trainers do."""
    open_before = set(GuessGame.sessions)
    env = _env(server.url)
    with pytest.raises(ServedEnvironmentError, match=r"failed on dataset row 1: reset failed: .*no such game"):
        env.start_episodes(_rows("4", "refuse"))
    env.shutdown()
    deadline = time.monotonic() + 10  # the server closes a game once it has seen its session's end
    # only this test's sessions: earlier tests' may still be closing (asynchronously), so the set can shrink too
    while GuessGame.sessions - open_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not GuessGame.sessions - open_before


def test_a_server_that_dies_fails_the_run_or_the_episode() -> None:
    doomed = Served()
    env = _env(doomed.url, on_server_error="count")
    metas = [s.metadata for s in env.start_episodes(_rows("4"))]
    doomed.stop()  # mid-episode
    ret = env.step([_call("4")], metas)
    assert ret.terminateds.tolist() == [True] and ret.rewards.tolist() == [0.0]
    assert "ConnectionError" in ret.metadata[0]["server_error"]
    starts = env.start_episodes(_rows("4"))  # a reset refused: the episode ends at its first turn, counted
    ret = env.step([_call("4")], [starts[0].metadata])
    assert ret.terminateds.tolist() == [True] and ret.metadata[0]["server_error"].startswith("reset failed")
    assert env.rollout_metrics()["env/server_errors"] == 2
    with pytest.raises(ServedEnvironmentError, match=r"failed on dataset row 0: reset failed: ConnectionError"):
        _env(doomed.url).start_episodes(_rows("4"))


SMALL = {
    "grpo.num_prompts_per_step": 2,
    "grpo.num_generations_per_prompt": 2,
    "policy.train_global_batch_size": 4,
    "policy.train_micro_batch_size": 4,
    "logger.progress_bar": False,
    "grpo.max_num_steps": 2,
    "grpo.max_rollout_turns": 2,
    "grpo.val_at_start": False,
    "grpo.val_period": 0,
    "grpo.val_at_end": False,
    "env.tool_call_parser": "tests.integration.test_served_env:boxed_as_guess",
    "env.openenv.action": "tests.integration.test_served_env:Guess",
    "env.openenv.reset_columns": "[answer]",
}


def boxed_as_guess(text: str) -> list[dict]:
    """The shipped model's `\\boxed{N}` as the served tool's call `step(value=N)`; no box, no call."""
    found = re.search(r"\\boxed\{([^}]*)\}", text)
    return [{"name": "step", "arguments": {"value": found.group(1)}}] if found else []


def test_the_cli_trains_2_steps_on_a_served_environment(tmp_path, capsys) -> None:
    server = Served(intro="")  # the shipped model answers only the bare arithmetic prompt with \\boxed{N}
    argv = ["train", "--run-dir", str(tmp_path / "run"), f"env.openenv.base_url={server.url}"]
    # asynchronous GRPO too: its producer plays the episodes on the same server; with d = 0 it logs what the
    # synchronous data-plane trainer logs
    on_async = ["train", "--run-dir", str(tmp_path / "async"), f"env.openenv.base_url={server.url}"]
    on_async += ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=0"]
    on_async += ["grpo.async_grpo.generator=thread"]
    try:
        assert main(argv + [f"{k}={v}" for k, v in SMALL.items()]) == 0
        assert main(on_async + [f"{k}={v}" for k, v in SMALL.items()]) == 0
    finally:
        server.stop()
    skip = ("per_sec", "latency", "timing", "bytes", "fraction")  # clocks, rates and byte counters
    steps, d0 = (metrics_by_step(tmp_path / name, skip=skip) for name in ("run", "async"))
    assert sorted(d0) == sorted(steps) == [1, 2]
    for step, m in steps.items():
        assert {k: d0[step][k] for k in m} == m, f"step {step}: async d=0 differs from sync on a served environment"
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["train/env/episodes"] == 4 and m["train/env/server_errors"] == 0
        assert m["train/env/tool_calls"] >= 4 * (m["train/avg_turns_per_sample"] - 1)  # each later turn follows a call
    assert sum(m["train/env/tool_calls"] for m in steps.values()) > 0  # the server was played
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "run" / "rollouts" / "step_000001.parquet").to_pylist()
    for row in rows:  # the server's reward is the episode's: 1 exactly when a guess was right
        parts = json.loads(row["env_metadata"])["reward_components"]
        assert row["reward_env"] == parts["get_reward"] and row["reward_env"] in (0.0, 1.0)
    # a server that is gone: one line naming it and the row, exit 1
    capsys.readouterr()
    gone = ["train", "--run-dir", str(tmp_path / "gone"), "env.openenv.base_url=http://127.0.0.1:9"]
    assert main(gone + [f"{k}={v}" for k, v in SMALL.items()]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("relayrl")]
    assert len(err) == 1 and "served environment http://127.0.0.1:9 failed on dataset row" in err[0], err


def test_config_refuses_two_environments_and_bad_tool_names() -> None:
    from relayrl.utils.config_io import ConfigError, load_config

    served = ["env.openenv.base_url=http://127.0.0.1:1", "env.openenv.action=tests.integration.test_served_env:Guess"]
    cfg = load_config(None, served)
    assert cfg.data.train.default_task == "environment" and cfg.env.on_server_error == "fail"
    with pytest.raises(ConfigError, match="env.openenv and env.environment_factory are both set"):
        load_config(None, [*served, "env.environment_factory=m:C"])
    with pytest.raises(ConfigError, match="on_server_error"):
        load_config(None, [*served, "env.on_server_error=retry"])
    with pytest.raises(ValueError, match="openenv tool_name 'reset' must be a public identifier"):
        openenv_environment("http://127.0.0.1:1", Guess, tool_name="reset")


class Silent:
    """A loopback server that accepts every connection and never answers (a wedged environment server)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:  # closed
                return

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_server_that_never_answers_fails_at_env_openenv_timeout_s() -> None:
    """Issue 28 item 5: the HTTP/WebSocket call to a served environment has a deadline, set by env.openenv.timeout_s
    (built through the config, as a run builds it); past it one line names the server, the row, the call, the
    deadline and its key."""
    from relayrl.environments.registry import build_tool_environments
    from relayrl.utils.config_io import load_config

    silent = Silent()
    try:
        keys = {k: v for k, v in SMALL.items() if k.startswith("env.")}
        keys |= {"env.openenv.base_url": silent.url, "env.openenv.timeout_s": 0.3}
        cfg = load_config(None, [f"{k}={v}" for k, v in keys.items()])
        env = build_tool_environments(cfg, None, None)["environment"]
        start = time.monotonic()
        with pytest.raises(ServedEnvironmentError) as err:
            env.start_episodes(_rows("4"))
        assert 0.3 <= time.monotonic() - start < 5
    finally:
        silent.close()
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"served environment {silent.url} failed on dataset row 0: reset ")
    assert "(no reply within 0.3s, env.openenv.timeout_s); env.on_server_error=count" in line

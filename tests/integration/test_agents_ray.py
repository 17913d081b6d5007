"""Environment classes and served environments on the Ray executor (issue 26 item 5): the data-plane trainer's
rollouts run in a Ray rollout actor, which builds its own instances of the class.

A class given to `relayrl.train` travels by value (here: made by `exec`, as a class of `__main__` is); a
`file.py:Class` entry is loaded again in the actor from its absolute path; a served environment (`env.openenv`) is
made again there from its config. The same 2-step multi-turn run (2 training workers, a tool that times out on an
odd answer, malformed calls) logs the same numbers on the local and the Ray executor. As in test_agents.py the
shipped model's `\\boxed{N}` is read as a call of the class's `check` tool. Outside the suite (`-m slow`): the same
comparison for the legacy GRPO trainer, PPO and a served environment's full run.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import relayrl
from relayrl.algorithms.async_state import ASYNC_STATE
from relayrl.algorithms.setup import SetupError
from relayrl.cli.main import main
from relayrl.config import MasterConfig
from relayrl.environments.registry import build_tool_environments
from relayrl.experience.ray_rollout import receive_environments, ship_environments
from relayrl.utils.config_io import load_config
from relayrl.utils.state_file import load_state_file
from tests.agent_envs import CHECKER, MULTI_TURN, SLOW_CHECKER, boxed_as_call, checks, user_class
from tests.helpers import metrics_by_step, sigkill_after_checkpoint

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray
RAY_NUM_CPUS = 6  # the shared `ray_cluster` fixture (tests/conftest.py) reads it

SMALL = {
    **MULTI_TURN,
    "policy.train_micro_batch_size": 2,
    "grpo.max_num_steps": 2,
    "checkpointing.enabled": False,
    "cluster.workers_per_node": 2,
    "cluster.deterministic": True,
    "env.tool_timeout_s": 1.0,  # far above a quick call's time on a busy machine: only the hung calls time out
}


def _by_value() -> type:
    """The class as `__main__` would hold it: no importable module, so cloudpickle sends it by value."""
    return user_class(SLOW_CHECKER, "SlowChecker")


@pytest.fixture(scope="module")
def runs(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The same run on the local executor and on Ray (2 training workers each)."""
    root = tmp_path_factory.mktemp("agents_ray")
    os.environ["RELAYRL_REFIT_IPC_DIR"] = str(root)  # ZMQ IPC sockets private to this module
    out = {}
    try:
        for executor in ("local", "ray"):
            result = relayrl.train(
                environment_factory=_by_value(),
                reward_fns=[checks],
                run_dir=root / executor,
                overrides={**SMALL, "cluster.executor": executor},
            )
            out[executor] = result.run_dir
        yield out
    finally:
        os.environ.pop("RELAYRL_REFIT_IPC_DIR", None)


def test_a_multi_turn_run_on_ray_logs_the_local_executors_numbers(runs) -> None:
    local, on_ray = metrics_by_step(runs["local"]), metrics_by_step(runs["ray"])
    assert sorted(local) == sorted(on_ray) == [1, 2]
    keys = ("train/reward", "train/loss", "train/grad_norm", "train/reward/checks", "train/avg_turns_per_sample")
    keys += tuple(k for k in local[1] if k.startswith(("train/env/", "train/advantages/")) and "latency" not in k)
    assert {"train/env/tool_calls", "train/env/tool_timeouts", "train/advantages/mean"} <= set(keys)
    for step in (1, 2):
        assert {k: on_ray[step][k] for k in keys} == {k: local[step][k] for k in keys}, step
    total = {
        k: sum(local[s][f"train/env/{k}"] for s in (1, 2))
        for k in ("tool_calls", "tool_timeouts", "invalid_tool_calls")
    }
    assert total["tool_calls"] > 0 and total["invalid_tool_calls"] > 0  # the tool ran; malformed calls counted
    assert 0 < total["tool_timeouts"] < total["tool_calls"]  # the deadline cut the odd answers' calls in the actor
    # the flight recorder has the turns on Ray too: the same conversations, rewards and tool calls
    recorded_calls = 0
    for step in (1, 2):
        rows = {
            executor: pq.read_table(run / "rollouts" / f"step_{step:06d}.parquet").to_pylist()
            for executor, run in runs.items()
        }
        same = ("prompt", "completion", "reward_env", "env_metadata", "turns")  # turns: role, tokens, calls, results
        assert [{k: r[k] for k in same} for r in rows["ray"]] == [{k: r[k] for k in same} for r in rows["local"]]
        recorded_calls += sum("tool_calls" in t for r in rows["ray"] for t in json.loads(r["turns"]))
        calls = [len(json.loads(r["tool_latency_s"])) for r in rows["ray"]]
        assert calls == [len(json.loads(r["tool_latency_s"])) for r in rows["local"]]
        cut = [t for r in rows["ray"] for t in json.loads(r["tool_latency_s"]) if t >= 1.0]
        assert cut == [1.0] * int(on_ray[step]["train/env/tool_timeouts"])  # a hung call cost its deadline, not 4 s
    assert recorded_calls == total["tool_calls"]  # every call that ran, with its arguments and result


#: Asynchronous GRPO on Ray generates on a dedicated worker (the producer's rollout actor drives it).
ASYNC_D0 = {
    "grpo.async_grpo.enabled": True,
    "grpo.async_grpo.max_trajectory_age_steps": 0,
    "policy.generation.colocated.enabled": False,
    "policy.generation.colocated.resources.num_nodes": 1,
    "policy.generation.colocated.resources.workers_per_node": 1,
    "grpo.val_at_start": True,  # validation's episodes (as the producer starts): the trainer's actor, its own instances
    "grpo.max_val_samples": 2,
    "grpo.val_batch_size": 2,
}


def test_multi_turn_async_on_ray_at_age_zero_logs_the_synchronous_numbers(runs, tmp_path, monkeypatch) -> None:
    """Environment classes on asynchronous GRPO on Ray, d = 0: the producer's rollout actor plays the episodes with
    instances of its own (malformed calls penalised per token in its rows) and the run logs what the synchronous run
    logs, its `train/env/*` counts and recorded turns included; validation at the start plays on the trainer's actor
    while the producer makes batch 1, and adds nothing to the producer's counts. No key outlives its step or the
    run in the Ray store."""
    from tests.integration.test_grpo_async_ray import counting_live_keys

    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))
    held: list[int] = []
    with counting_live_keys(held):
        run = relayrl.train(
            environment_factory=_by_value(),
            reward_fns=[checks],
            run_dir=tmp_path / "async",
            overrides={**SMALL, **ASYNC_D0, "cluster.executor": "ray"},
        ).run_dir
    assert len(held) == 3 and held[-1] == 0, held  # after steps 1 and 2, then after the trainer closed: none left
    assert all(n <= 4 for n in held[:-1]), (
        held
    )  # at most the next batch (d = 0: one batch of 4 rows), never a trained one
    sync, d0 = metrics_by_step(runs["ray"]), metrics_by_step(run)
    assert sorted(sync) == [1, 2] and sorted(d0) == [0, 1, 2]  # step 0: validation at the start
    keys = ("train/reward", "train/loss", "train/grad_norm", "train/reward/checks", "train/avg_turns_per_sample")
    keys += tuple(k for k in sync[1] if k.startswith(("train/env/", "train/advantages/")) and "latency" not in k)
    for step in (1, 2):
        assert {k: d0[step][k] for k in keys} == {k: sync[step][k] for k in keys}, step
        assert d0[step]["train/async/generating_weight_version"] == step - 1
        assert d0[step]["train/env/episodes"] == 4  # the producer's 4 episodes; validation's are not counted here
    assert sum(d0[s]["train/env/invalid_tool_calls"] for s in (1, 2)) > 0
    assert min(d0[s]["train/advantages/min"] for s in (1, 2)) == -1.0  # the malformed calls' tokens: penalised
    assert "validation/accuracy" in d0[0] and not any(k.startswith("train/") for k in d0[0])
    same = ("prompt", "completion", "reward_env", "env_metadata", "turns")
    for step in (1, 2):  # the flight recorder's rows came from the producer's actor with each batch
        rows = [pq.read_table(r / "rollouts" / f"step_{step:06d}.parquet").to_pylist() for r in (runs["ray"], run)]
        assert [{k: r[k] for k in same} for r in rows[1]] == [{k: r[k] for k in same} for r in rows[0]]
        assert any('"role": "tool"' in r["turns"] for r in rows[1])


def test_a_failing_reset_on_ray_ends_the_cli_run_with_one_line(ray_cluster, tmp_path, monkeypatch, capsys) -> None:
    """A `file.py:Class` entry (relative to the driver's directory) is loaded in the rollout actor; its `reset`
    raising there ends the run with the local executor's line, naming the class and the row."""
    (tmp_path / "bad_env.py").write_text(
        SLOW_CHECKER.replace("SlowChecker", "Picky").replace(
            "self.answer, self.checked = str(answer), []",
            "self.answer, self.checked = str(1 // (int(answer) - 50)), []",
        )
    )
    data = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(48, 56)]  # answer 50 divides by zero: row 2
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))
    argv = ["train", "--run-dir", "run", "env.environment_factory=bad_env.py:Picky", "data.shuffle=false"]
    argv += ["data.train.source=file", "data.train.path=data.jsonl", "cluster.executor=ray"]
    argv += [f"{k}={v}" for k, v in {**SMALL, "cluster.workers_per_node": 1}.items()]  # fewer actors to start
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("relayrl")]
    assert len(err) == 1, err
    assert "environment class Picky.reset failed on dataset row 2: ZeroDivisionError: integer division" in err[0]


def test_a_class_the_actor_cannot_load_is_refused_before_the_model_loads(ray_cluster, tmp_path, monkeypatch) -> None:
    """A class of a module only the driver can import (its directory is on the driver's sys.path alone) and a class
    that does not pickle: one line each, naming the class and the fix, before any model or worker starts."""
    (tmp_path / "private_envs.py").write_text(SLOW_CHECKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import private_envs  # type: ignore[import-not-found]

    namespace: dict = {}
    exec(SLOW_CHECKER + "\nimport threading\n\nclass Locked(SlowChecker):\n    guard = threading.Lock()\n", namespace)
    try:
        for cls, problem in (
            (private_envs.SlowChecker, "cannot be rebuilt in the Ray rollout actor: ModuleNotFoundError: No module"),
            (namespace["Locked"], "cannot be sent to the Ray rollout actor: TypeError: cannot pickle"),
        ):
            with pytest.raises(SetupError) as err:
                relayrl.train(
                    environment_factory=cls,
                    run_dir=tmp_path / cls.__name__,
                    overrides={**SMALL, "cluster.executor": "ray"},
                )
            line = str(err.value)
            assert "\n" not in line and line.startswith(f"environment class {cls.__name__} {problem}"), line
            assert "env.environment_factory=file.py:Class" in line
            assert not (tmp_path / cls.__name__ / "config.yaml").exists()  # written once the model has loaded
    finally:
        sys.modules.pop("private_envs", None)


def play_served(envs: tuple, cfg: MasterConfig) -> dict:
    """In a Ray worker: receive the environments as the rollout actor does, play two episodes on the server."""
    from tests.integration.test_served_env import _call

    env = receive_environments(envs, cfg)["environment"]
    rows = [{"row": k + 1, "prompt": "Find it.", "columns": {"answer": a}} for k, a in enumerate(("4", "9"))]
    metas = [s.metadata for s in env.start_episodes(rows)]
    ret = env.step([_call("3"), _call("9")], metas)  # row 1 wrong, row 2 right: the server says done
    end = env.end_episodes([_call("3")], [ret.metadata[0]])
    return {
        "pid": os.getpid(),
        "tools": [o.get("chat") for o in ret.observations],
        "rewards": ret.rewards.tolist() + end.rewards.tolist(),
        "done": ret.terminateds.tolist(),
        "metrics": env.rollout_metrics(),
    }


def test_a_served_environment_from_the_config_plays_in_a_ray_worker(ray_cluster) -> None:
    """`env.openenv` on Ray: the served environment built from the config is sent as the rollout actor gets it and
    made again in a Ray worker, which plays episodes against the real OpenEnv server on loopback."""
    pytest.importorskip("openenv")
    from tests.integration.test_served_env import Served

    server = Served()
    try:
        keys = {
            "base_url": server.url,
            "action": "tests.integration.test_served_env:Guess",
            "reset_columns": "[answer]",
        }
        cfg = load_config(None, [f"env.openenv.{k}={v}" for k, v in keys.items()] + ["cluster.executor=ray"])
        envs = ship_environments(build_tool_environments(cfg, None, None))
        out = ray.get(ray.remote(num_cpus=0)(play_served).remote(envs, cfg), timeout=60)
    finally:
        server.stop()
    assert out["pid"] != os.getpid()
    assert out["tools"] == [[{"role": "tool", "name": "step", "content": c}] for c in ("wrong", "correct")]
    assert out["done"] == [False, True] and out["rewards"] == [0.0, 1.0, 0.0]  # the server's rewards
    m = out["metrics"]
    assert (m["env/episodes"], m["env/tool_calls"], m["env/server_errors"]) == (2, 2, 0)


def _same_numbers(root: Path, overrides: dict, **given) -> dict[str, float]:
    """Run `overrides` on both executors; assert every reward, loss, env count and advantage is equal; the counts."""
    steps = {}
    for executor in ("local", "ray"):
        run = relayrl.train(run_dir=root / executor, overrides={**overrides, "cluster.executor": executor}, **given)
        steps[executor] = metrics_by_step(run.run_dir)
    local, on_ray = steps["local"], steps["ray"]
    words = ("reward", "loss", "grad_norm", "env/", "advantages/", "critic/")
    keys = [k for k in local[1] if any(w in k for w in words) and "latency" not in k]
    assert sorted(local) == sorted(on_ray) == [1, 2] and "train/env/episodes" in keys
    for step in (1, 2):
        assert {k: on_ray[step][k] for k in keys} == {k: local[step][k] for k in keys}, step
    return {k: sum(local[s][k] for s in (1, 2)) for k in keys if k.startswith("train/env/")}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["legacy", "ppo", "served"])
def test_other_trainers_and_a_served_run_on_ray_log_the_local_numbers(ray_cluster, tmp_path, monkeypatch, trainer):
    """Beside the suite (`-m slow`, ~40 s each): the legacy GRPO trainer (its rollouts stay in the driver), PPO on
    the data plane (its rollout actor on Ray) and a served environment's 2-step run on Ray, each against the local
    executor."""
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))
    if trainer == "served":
        pytest.importorskip("openenv")
        from tests.integration.test_served_env import SMALL as SERVED
        from tests.integration.test_served_env import Served

        server = Served(intro="")
        try:
            keys = {**SERVED, "env.openenv.reset_columns": ["answer"], "env.openenv.base_url": server.url}
            keys |= {k: v for k, v in SMALL.items() if k.startswith(("cluster.", "policy.train_micro", "checkpoint"))}
            counts = _same_numbers(tmp_path, keys)
        finally:
            server.stop()
        assert counts["train/env/tool_calls"] > 0 and counts["train/env/server_errors"] == 0
        return
    overrides = {**SMALL, "data_plane.enabled": False} if trainer == "legacy" else {}
    if trainer == "ppo":
        overrides = {k.replace("grpo.", "ppo."): v for k, v in SMALL.items() if "invalid_tool_call" not in k}
        overrides |= {"algorithm": "ppo", "value.train_global_batch_size": 4, "value.train_micro_batch_size": 2}
    counts = _same_numbers(tmp_path, overrides, environment_factory=_by_value(), reward_fns=[checks])
    assert counts["train/env/tool_calls"] > 0 and counts["train/env/tool_timeouts"] > 0


@pytest.mark.slow
def test_multi_turn_async_on_ray_resumes_exactly_after_sigkill(ray_cluster, tmp_path, monkeypatch) -> None:
    """Beside the suite (`-m slow`): async GRPO on Ray, d = 1, 4 steps, a `file.py:Class` environment. The driver
    SIGKILLed the moment its step-2 checkpoint (batches 3 and 4 rolled out, their episodes ended, not trained on) is
    published, then resumed: it logs the uninterrupted run's metrics and recorded turns (the batches in flight come
    back from the checkpoint with their rows, counts and turns, never replayed against new instances)."""
    checker = tmp_path / "checker.py"
    checker.write_text(f"import re\n{CHECKER}\n\n{inspect.getsource(boxed_as_call)}")
    keys = {k: v for k, v in SMALL.items() if not k.startswith(("env.tool_", "grpo.val_"))}
    keys |= {k: v for k, v in ASYNC_D0.items() if not k.startswith("grpo.val_")}
    keys |= {"grpo.async_grpo.max_trajectory_age_steps": 1, "grpo.max_num_steps": 4, "checkpointing.enabled": True}
    keys |= {"checkpointing.save_period": 2, "grpo.val_period": 0, "cluster.executor": "ray"}
    keys |= {"env.environment_factory": f"{checker}:Checker", "env.tool_call_parser": f"{checker}:boxed_as_call"}
    args = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))
    assert main(["train", "--run-dir", str(tmp_path / "a"), *args]) == 0
    killed = tmp_path / "killed"
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)  # the killed driver joins this cluster
    sigkill_after_checkpoint(["-m", "relayrl.cli.main", "train", "--run-dir", str(killed), *args],
                             killed / "checkpoints" / "step_2")  # fmt: skip
    saved = load_state_file(killed / "checkpoints" / "step_2" / ASYNC_STATE)
    assert [(b["index"], b["version"]) for b in saved["batches"]] == [(3, 1), (4, 2)]
    assert all(b["rollout_metrics"]["env/episodes"] == 4 for b in saved["batches"])
    assert main(["train", "--run-dir", str(killed), *args]) == 0
    skip = ("per_sec", "bytes", "fraction", "latency", "timing")
    reference, resumed = (metrics_by_step(d, ("train/",), skip=skip) for d in (tmp_path / "a", killed))
    assert sorted(reference) == [1, 2, 3, 4] and sum(reference[s]["train/env/tool_calls"] for s in reference) > 0
    for step in range(1, 5):
        assert resumed[step] == reference[step], f"step {step} differs (steps 3-4: after the resume)"
    for step in (3, 4):
        name = f"rollouts/step_{step:06d}.parquet"
        a, b = (pq.read_table(d / name).drop(["sample_key", "tool_latency_s"]) for d in (tmp_path / "a", killed))
        assert a.num_rows == 4 and a.equals(b), f"recorded rollouts of step {step} differ after the resume"


CLOSER = """
import itertools, os

class Closer:
    made = itertools.count()

    def __init__(self):
        self.n = next(Closer.made)
        self._log("open")

    def _log(self, what):
        with open(LOG, "a") as f:
            f.write(f"{what} {os.getpid()}-{self.n}\\n")

    def reset(self, answer, **row):
        pass

    def check(self, value: str) -> str:
        \"\"\"Check a candidate answer.

        Args:
            value: the candidate answer
        \"\"\"
        return "checked"

    def get_reward(self) -> float:
        if self.n == 5:
            raise RuntimeError("get_reward failed")
        return 0.0

    def close(self):
        self._log("close")
"""


@pytest.mark.slow
def test_async_on_ray_closes_the_producers_episodes_when_the_run_fails(ray_cluster, tmp_path, monkeypatch) -> None:
    """Beside the suite (`-m slow`): batch 1's episodes end and close in the producer's actor; in batch 2 its instance
    5 fails in `get_reward`, the run ends with the class's one line, and every instance the actor made is closed."""
    log = tmp_path / "instances.log"
    (tmp_path / "closer.py").write_text(
        f"import re\nLOG = {str(log)!r}\n{CLOSER}\n\n{inspect.getsource(boxed_as_call)}"
    )
    monkeypatch.setenv("RELAYRL_REFIT_IPC_DIR", str(tmp_path))
    keys = {k: v for k, v in SMALL.items() if not k.startswith("env.tool_")}
    keys |= {k: v for k, v in ASYNC_D0.items() if not k.startswith("grpo.val_")}
    keys |= {"grpo.val_period": 0, "cluster.executor": "ray"}
    keys |= {"env.environment_factory": f"{tmp_path}/closer.py:Closer", "grpo.async_grpo.max_trajectory_age_steps": 1}
    keys["env.tool_call_parser"] = f"{tmp_path}/closer.py:boxed_as_call"
    with pytest.raises(Exception, match="Closer.get_reward failed on dataset row"):
        relayrl.train(run_dir=tmp_path / "run", overrides=keys)
    lines = log.read_text().split()
    opened = set(lines[1::2][i] for i, w in enumerate(lines[0::2]) if w == "open")
    closed = [lines[1::2][i] for i, w in enumerate(lines[0::2]) if w == "close"]
    assert len(opened) >= 6 and sorted(closed) == sorted(opened), lines  # each one closed, once

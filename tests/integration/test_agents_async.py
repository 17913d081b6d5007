"""Environment classes on asynchronous GRPO (issue 26 item 5): multi-turn tool-use rollouts made by the producer, one
instance per rollout in the producer's own copy of the environments, malformed calls penalised per token. d = 1 is
deterministic and leaks no store key, d = 0 logs what the synchronous data-plane trainer logs (metrics, `train/env/*`
counts and the flight recorder's turns), and a run SIGKILLed with multi-turn rollouts in flight resumes to the
uninterrupted run's metrics and recorded rows (the batches in flight come back from the checkpoint's copy of the
store, never replayed against new instances). Every trainer closes the instances still open when a run fails.

As in test_agents.py, the shipped model's `\\boxed{N}` reply is read as a call of the class's `check` tool (a
negative N as a malformed call).
"""

from __future__ import annotations

import inspect
import itertools
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import relayrl
from relayrl.algorithms.async_state import ASYNC_STATE
from relayrl.cli.main import main
from relayrl.utils.state_file import load_state_file
from tests.agent_envs import CHECKER, MULTI_TURN, boxed_as_call
from tests.helpers import EXACT_RUN, metrics_by_step, sigkill_after_checkpoint

STEPS = 4
SMALL = (
    *EXACT_RUN,
    # the parser is in the class's file; validation every 2 steps (below)
    *(
        f"{k}={v}"
        for k, v in MULTI_TURN.items()
        if k not in ("env.tool_call_parser", "grpo.val_period", "grpo.val_at_end")
    ),
    "policy.model_name=builtin:tiny-arith",
    "policy.generation.max_new_tokens=16",
    f"grpo.max_num_steps={STEPS}",
    "grpo.val_period=2",  # validation rolls out episodes on the trainer's thread while the producer rolls out its own
    "grpo.max_val_samples=2",
    "grpo.val_batch_size=2",
    "checkpointing.save_period=2",
)
# the producer's engine in its thread: what the generation process samples is the same (test_grpo_async), and
# starting one per run would cost more than these runs take
ASYNC = ("grpo.async_grpo.enabled=true", "grpo.async_grpo.generator=thread")
# the killed run keeps its batches in flight in the checkpoint's copy of the store (multi-turn rows, with their
# turns and penalties, through the data plane's checkpoint) rather than in the async state file
IN_STORE = ("checkpointing.save_data_plane=true",)
SKIP = ("per_sec", "bytes", "fraction", "latency")  # machine-dependent rates, byte counters, tool latency (a clock)


def _overrides(checker: Path, *extra: str) -> list[str]:
    return [
        f"env.environment_factory={checker}:Checker",
        f"env.tool_call_parser={checker}:boxed_as_call",
        *SMALL,
        *extra,
    ]


def _metrics(run_dir: Path) -> dict[int, dict]:
    return metrics_by_step(run_dir, ("train/", "validation/"), skip=SKIP)


def _rollouts(run_dir: Path, step: int) -> pq.Table:
    """A step's recorded rows, less what differs between equal runs: fresh sample keys and the tools' latency."""
    return pq.read_table(run_dir / "rollouts" / f"step_{step:06d}.parquet").drop(["sample_key", "tool_latency_s"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    """Each configuration once: async d = 1 (counting the store's keys after every step), the synchronous data-plane
    trainer, async d = 0, and a second d = 1 run SIGKILLed at its step-2 checkpoint, then resumed (it is also the
    determinism check: its steps 1-2 ran in the killed process, 3-4 after the resume)."""
    from relayrl.algorithms.grpo_sync import GRPOSyncSteps

    root = tmp_path_factory.mktemp("agents_async")
    checker = root / "checker.py"
    checker.write_text(f"import re\n{CHECKER}\n\n{inspect.getsource(boxed_as_call)}")  # a user's file, parser too
    sys.modules.pop("relayrl_reward_checker", None)

    def train(name: str, *extra: str) -> Path:
        assert main(["train", "--run-dir", str(root / name), *_overrides(checker, *extra)]) == 0
        return root / name

    out: dict[str, object] = {}
    held: list[int] = []
    step, close = GRPOSyncSteps.step, GRPOSyncSteps.close

    def live_keys(steps: GRPOSyncSteps) -> int:
        if steps.source.producer._thread.is_alive():  # count once production is idle: no half-put batch
            steps.source.producer.drain()
        client = steps.policy.dp_client
        return sum(len(client.keys(pid)) for pid in client.bytes_held() if pid != "val")

    def step_and_count(self, batch, index):
        result = step(self, batch, index)
        held.append(live_keys(self))
        return result

    def close_and_count(self):
        close(self)
        held.append(live_keys(self))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GRPOSyncSteps, "step", step_and_count)
        patch.setattr(GRPOSyncSteps, "close", close_and_count)
        out["a"] = train("a", *ASYNC)
    out["held"] = held
    out["sync"] = train("sync")
    out["d0"] = train("d0", *ASYNC, "grpo.async_grpo.max_trajectory_age_steps=0")
    killed = root / "killed"
    argv = ["-m", "relayrl.cli.main", "train", "--run-dir", str(killed), *_overrides(checker, *ASYNC, *IN_STORE)]
    sigkill_after_checkpoint(argv, killed / "checkpoints" / "step_2")
    out["saved"] = load_state_file(killed / "checkpoints" / "step_2" / ASYNC_STATE)
    out["resumed"] = train("killed", *ASYNC, *IN_STORE)
    return out


def test_multi_turn_async_is_deterministic_and_leaks_no_key(runs) -> None:
    a, b = _metrics(runs["a"]), _metrics(runs["resumed"])
    assert sorted(a) == list(range(1, STEPS + 1))
    assert a == b  # the second run (killed after step 2, then resumed) logs the same numbers
    # `relayrl diff` agrees, recorded samples included: the tools' latency is a clock it never compares
    assert main(["diff", str(runs["a"]), str(runs["resumed"])]) == 0
    assert [a[s]["train/async/trajectory_age_mean"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]
    # rollouts of more than one turn: the tool ran, and its answer was fed back for a second reply
    assert sum(a[s]["train/env/tool_calls"] for s in a) > 0 and max(a[s]["train/max_turns_per_sample"] for s in a) == 2
    assert all(a[s]["train/env/episodes"] == 4 for s in a)
    assert "validation/accuracy" in a[2] and "validation/accuracy" in a[4]
    assert all(not k.startswith("train/env/") for s in a for k in a[s] if "validation" in k)
    # after step k the weights of version k allow batches up to k + 2 (4 rows each; the run has 4): every key is
    # trained on and cleared with its step, none is left when the run ends
    assert runs["held"] == [2 * 4, 2 * 4, 1 * 4, 0, 0]


def test_age_zero_logs_what_the_synchronous_trainer_logs(runs) -> None:
    sync, d0 = _metrics(runs["sync"]), _metrics(runs["d0"])
    assert sorted(d0) == list(range(1, STEPS + 1))
    for step, row in sync.items():
        assert {k: d0[step][k] for k in row} == row, f"step {step}: async d=0 differs from sync"
    assert any(k.startswith("train/env/") for k in sync[1])
    assert sum(sync[s]["train/env/invalid_tool_calls"] for s in sync) > 0  # penalised (invalid_tool_call_advantage)
    assert min(sync[s]["train/advantages/min"] for s in sync) == -1.0
    tool_turns = 0
    for step in range(1, STEPS + 1):  # the flight recorder's rows, turns included, are the synchronous ones
        rows = _rollouts(runs["sync"], step)
        assert _rollouts(runs["d0"], step).equals(rows), f"recorded rollouts of step {step} differ"
        tool_turns += sum('"role": "tool"' in t for t in rows.column("turns").to_pylist())
    assert tool_turns > 0


def test_sigkill_with_multi_turn_rollouts_in_flight_resumes_exactly(runs) -> None:
    # d = 1: after step 2, batch 3 (version 1) and batch 4 (version 2) were rolled out, their episodes ended, and not
    # yet trained on: they come back from the checkpoint with their rows, counts and recorded turns
    assert [(b["index"], b["version"]) for b in runs["saved"]["batches"]] == [(3, 1), (4, 2)]
    # ... in the checkpoint's copy of the store (checkpointing.save_data_plane), not in the state file
    assert runs["saved"]["rows_in_store"] and not any("rows" in b for b in runs["saved"]["batches"])
    assert all(b["rollout_metrics"]["env/episodes"] == 4 for b in runs["saved"]["batches"])
    reference, resumed = _metrics(runs["a"]), _metrics(runs["resumed"])
    for step in range(3, STEPS + 1):
        assert resumed[step] == reference[step], f"step {step} differs after resume"
        assert _rollouts(runs["resumed"], step).equals(_rollouts(runs["a"], step)), f"step {step}'s rows differ"


class Closer:
    """Records its instances' creation and closing; fails in `reset` or `get_reward` of one instance."""

    log: list[str] = []
    fail: tuple[str, int] = ("", -1)
    made = itertools.count()

    def __init__(self) -> None:
        self.n = next(Closer.made)
        Closer.log.append(f"open {self.n}")

    def reset(self, answer, **row) -> None:
        if Closer.fail == ("reset", self.n):
            raise RuntimeError("reset failed")

    def check(self, value: str) -> str:
        """Check a candidate answer.

        Args:
            value: the candidate answer
        """
        return "checked"

    def get_reward(self) -> float:
        if Closer.fail == ("get_reward", self.n):
            raise RuntimeError("get_reward failed")
        return 0.0

    def close(self) -> None:
        Closer.log.append(f"close {self.n}")


@pytest.mark.parametrize(
    ("trainer", "fail"),
    [
        ("data_plane.enabled=false", ("reset", 5)),  # legacy: the instance whose reset raised
        ("data_plane.enabled=true", ("reset", 5)),
        (" ".join(ASYNC), ("get_reward", 5)),  # the producer's episodes still open in its copy
    ],
    ids=["legacy", "data_plane", "async"],
)
def test_every_trainer_closes_the_environments_of_a_failed_run(tmp_path, trainer, fail) -> None:
    """Batch 1's four episodes end and close; in batch 2 instance 5 fails, and the run ends with one error. Every
    instance made is closed by then: the one that failed, and those whose episodes were still open."""
    Closer.log, Closer.fail, Closer.made = [], fail, itertools.count()
    overrides = [*SMALL, *trainer.split(), "grpo.val_period=0", f"env.tool_call_parser={__name__}:boxed_as_call"]
    with pytest.raises(Exception, match=f"Closer.{fail[0]} failed on dataset row"):
        relayrl.train(environment_factory=Closer, run_dir=tmp_path / "run", overrides=overrides)
    opened = {x.split()[1] for x in Closer.log if x.startswith("open")}
    closed = [x.split()[1] for x in Closer.log if x.startswith("close")]
    assert len(opened) >= 6 and sorted(closed) == sorted(opened), Closer.log  # each one closed, once

"""Resume never silently changes the run, and a crash's half-written files never stop it (issue 31, items 1 and 2).

One tiny 3-step run (checkpoints after every step, a cosine LR schedule, a JSONL dataset) is trained once for the
module per trainer; each test damages a copy of it as a user's bad day would and runs `relayrl train` on it: exit 2
(or 1) with one `relayrl: error:` line and nothing of the run lost or rewritten, or exit 0 and the run continued
exactly. Probes whose code differs between the data-plane trainer (default) and the legacy one
(`data_plane.enabled=false`) run on both (`BOTH_TRAINERS`); the others say which shared code they exercise.
"""

from __future__ import annotations

import json
import math
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.utils.checkpoint import verify_checkpoint
from tests.helpers import CHECKPOINT_EVERY_STEP, metrics_by_step, tiny_grpo_overrides

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10) for b in range(4)]
LR, MIN_LR_RATIO = 1e-3, 0.1


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


#: The overrides that select each GRPO trainer: rollout tensors in the data plane's store (default), or in the driver.
TRAINERS = {"data_plane": (), "legacy": ("data_plane.enabled=false",)}
#: A probe whose code differs between the trainers: run on a copy of each trainer's run (`run` takes the param).
BOTH_TRAINERS = pytest.mark.parametrize("run", list(TRAINERS), indirect=True)


def _overrides(model_dir: Path, data: Path, steps: int, trainer: str = "data_plane") -> list[str]:
    return tiny_grpo_overrides(
        model_dir,
        *CHECKPOINT_EVERY_STEP,
        "logger.flight_recorder.enabled=false",
        "policy.scheduler.name=cosine",
        f"policy.scheduler.min_lr_ratio={MIN_LR_RATIO}",
        "data.train.source=file",
        f"data.train.path={data}",
        f"grpo.max_num_steps={steps}",
        *TRAINERS[trainer],
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Callable[[str], Path]:
    """The module's 3-step run of a trainer, trained on its first use."""
    runs: dict[str, Path] = {}

    def of(trainer: str) -> Path:
        if trainer not in runs:
            root = tmp_path_factory.mktemp(f"faults_resume_{trainer}")
            data = _write_rows(root / "data.jsonl", ROWS)
            run = root / "run"
            assert main(["train", "--run-dir", str(run), *_overrides(tiny_model_dir, data, 3, trainer)]) == 0
            runs[trainer] = run
        return runs[trainer]

    return of


@pytest.fixture
def run(request: pytest.FixtureRequest, trained: Callable[[str], Path], tmp_path: Path) -> Path:
    """A copy of a trainer's run (the data-plane one unless the test is `BOTH_TRAINERS`) whose config reads its own
    copy of the data (so a test may change it)."""
    trained_run = trained(getattr(request, "param", "data_plane"))
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    data = shutil.copy(trained_run.parent / "data.jsonl", tmp_path / "data.jsonl")
    config = copy / "config.yaml"  # the checkpoints' own copies are sealed by their manifests: left as they are
    config.write_text(config.read_text().replace(str(trained_run.parent / "data.jsonl"), str(data)))
    return copy


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run but the lock files (a refused command took the lock, as any command does)."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".owner.lock"
    }


def _one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("relayrl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _train(run: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["train", "--run-dir", str(run), *args])
    return code, capsys.readouterr().err


# The config.yaml probes: the CLI refuses before any trainer is chosen (`config_io.check_recorded_config`), so the
# data-plane run covers both trainers.
def test_a_missing_config_is_one_line_and_never_the_defaults(run, capsys):
    (run / "config.yaml").unlink()
    before = _snapshot(run)
    code, err = _train(run, capsys, "grpo.max_num_steps=4")
    line = _one_error(err)
    assert code == 2 and f"{run}/config.yaml is missing" in line
    assert f"cp {run}/checkpoints/step_3/config.yaml {run}/config.yaml" in line
    assert _snapshot(run) == before  # nothing written, nothing trained


@pytest.mark.parametrize("cut", ["mid_line", "line_boundary"])
def test_a_truncated_config_is_one_line_and_left_as_it_is(run, capsys, cut):
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text[:301] if cut == "mid_line" else "".join(text.splitlines(True)[:40]))
    before = _snapshot(run)
    code, err = _train(run, capsys, "grpo.max_num_steps=4")
    line = _one_error(err)
    assert code == 2 and "config.yaml" in line and f"cp {run}/checkpoints/step_3/config.yaml" in line
    if cut == "line_boundary":
        assert "lacks" in line and "truncated" in line
    assert _snapshot(run) == before


def _damage(step_dir: Path) -> None:
    weights = step_dir / "policy" / "weights" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[5000] ^= 0xFF
    weights.write_bytes(bytes(data))


@BOTH_TRAINERS  # each trainer's policy takes the weights (legacy: `lm_policy.Policy`, else via the store's facade)
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumes(run, capsys):
    _damage(run / "checkpoints" / "step_3")
    step_3 = metrics_by_step(run)[3]
    code, err = _train(run, capsys, "grpo.max_num_steps=4")
    assert code == 0 and "Traceback" not in err, err
    assert metrics_by_step(run)[3] == step_3  # step 3 again from step_2: exactly the step it was
    skipped = [ln for ln in err.splitlines() if "Skipping checkpoint" in ln]
    assert len(skipped) == 1 and "step_3" in skipped[0] and "model.safetensors does not match its sha256" in skipped[0]
    assert verify_checkpoint(run / "checkpoints" / "step_4") is None
    info = json.loads((run / "checkpoints" / "step_4" / "training_info.json").read_text())
    assert info["total_steps"] == 4 and info["schedule_steps"] == 3


# Which checkpoint to resume, and the refusal to start over, are set-up's (`resume.refuse_lost_checkpoints`), before
# the trainer's kind matters: one trainer covers both.
def test_no_intact_checkpoint_refuses_to_start_over_unless_restart(run, capsys):
    for step in (1, 2, 3):
        _damage(run / "checkpoints" / f"step_{step}")
    metrics = (run / "metrics.jsonl").read_bytes()
    code, err = _train(run, capsys, "grpo.max_num_steps=4")
    line = _one_error(err)
    assert code == 2 and "all damaged or incomplete" in line and "--restart" in line
    assert len([ln for ln in err.splitlines() if "Skipping checkpoint" in ln]) == 3  # one line each
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_1", "step_2", "step_3"]

    code, err = _train(run, capsys, "--restart", "grpo.max_num_steps=1")
    assert code == 0 and "Traceback" not in err, err
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if "step_" in p.name)
    assert names == ["damaged_step_1", "damaged_step_2", "damaged_step_3", "step_1"]  # kept aside, not deleted


def _lr_by_step(run: Path) -> dict[int, float]:
    return {step: row["train/lr"] for step, row in metrics_by_step(run, ("train/lr",)).items()}


@BOTH_TRAINERS  # the horizon is set-up's, but each trainer's policy builds the scheduler and its step logs train/lr
def test_more_steps_continue_the_same_lr_schedule(run, capsys):
    lr = _lr_by_step(run)
    assert lr[1] > lr[2] > lr[3] > LR * MIN_LR_RATIO  # decaying over the 3 steps the run was started with
    code, err = _train(run, capsys, "grpo.max_num_steps=5")
    assert code == 0 and "keeps the horizon it started with (grpo.max_num_steps=3" in err
    resumed = _lr_by_step(run)
    assert [resumed[s] for s in (1, 2, 3)] == [lr[s] for s in (1, 2, 3)]
    assert resumed[4] == resumed[5] == pytest.approx(LR * MIN_LR_RATIO)  # the floor, never back up
    assert math.isclose(min(resumed.values()), LR * MIN_LR_RATIO)


# The training set is checked in set-up (`resume.check_dataset`) before the trainer's kind matters: one covers both.
@pytest.mark.parametrize("change", ["shrank", "edited"])
def test_a_dataset_that_changed_since_the_checkpoint_is_one_line(run, capsys, change):
    data = run.parent / "data.jsonl"
    rows = (
        ROWS[:4] if change == "shrank" else [{**r, "prompt": r["prompt"].replace("What is", "Compute")} for r in ROWS]
    )
    _write_rows(data, rows)
    before = _snapshot(run)
    code, err = _train(run, capsys, "grpo.max_num_steps=4")
    line = _one_error(err)
    assert code == 2 and "training set" in line
    assert ("has 4 prompts but" in line) if change == "shrank" else ("--allow-inexact-resume" in line)
    assert _snapshot(run) == before
    if change == "edited":  # told to: it resumes on the new data
        code, err = _train(run, capsys, "--allow-inexact-resume", "grpo.max_num_steps=4")
        assert code == 0 and 4 in metrics_by_step(run)


# The one logger every trainer writes through (`utils.logger`, the step tail in `runner`) repairs the line: one covers
# both.
def test_a_partial_last_metrics_line_is_dropped_with_a_warning(run, capsys):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train/lo')  # the writer died mid-line
    capsys.readouterr()
    assert main(["diff", str(run), str(run)]) == 0  # the reader tolerates it too
    assert "dropped a partial last line" in capsys.readouterr().err
    code, err = _train(run, capsys, "grpo.max_num_steps=4")
    assert code == 0 and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if "dropped a partial last line" in ln]) == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # every line whole
    assert sorted({r["step"] for r in rows}) == [1, 2, 3, 4] and "train/lo" not in rows[-1]


def test_a_failed_checkpoint_write_is_one_line_and_the_previous_checkpoint_resumes(run, capsys):
    """Writes past 200 kB fail (RLIMIT_FSIZE, as on a full disk): the step-4 checkpoint cannot be written. Both trainers
    write checkpoints through the same step tail (`runner.StepTail.save`) into the same policy class (the data-plane
    facade hands `save_checkpoint` to `lm_policy.Policy`): the data-plane run covers both."""
    limit = 200_000

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run), "grpo.max_num_steps=4"],
        preexec_fn=small_files,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _one_error(proc.stderr)
    assert proc.returncode == 1 and "the checkpoint of step 4 could not be written to" in line
    where = f"{run}/checkpoints/tmp_step_4/policy/optimizer/optimizer.pt"  # torch's writer, cut at the limit
    assert f"{where} (file size limit exceeded: the process may write files of at most {limit} bytes" in line
    assert "MiB free there" in line and "stays the resume point" in line and "unexpected pos" not in line
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if "step_" in p.name)
    assert names == ["step_1", "step_2", "step_3"] and verify_checkpoint(run / "checkpoints" / "step_3") is None
    code, err = _train(run, capsys, "grpo.max_num_steps=4")  # resumes from step 3, as the line says
    assert code == 0 and verify_checkpoint(run / "checkpoints" / "step_4") is None


# ---------------------------------------------------------------------------------------------------- reward functions
REWARDS = """
import sys, time

def nan_first(prompts, completions, **columns):
    return [float("nan")] + [0.0] * (len(completions) - 1)

def exits(prompts, completions, **columns):
    sys.exit(3)

def never_returns(prompts, completions, **columns):
    open(__file__ + ".called", "w").close()
    time.sleep(3600)
"""


@pytest.mark.parametrize(
    ("fn", "code", "expected"),
    [
        ("nan_first", 1, "non-finite reward at step 1 in 1 sample(s) (rows 0); stopped before any weight changed"),
        ("exits", 1, "reward function 'exits' failed on dataset row 1: it exited (SystemExit, code 3)"),
        ("never_returns", 1, "reward function 'never_returns' did not return within env.reward_timeout_s=1 s"),
    ],
    ids=["nan", "sys_exit", "deadline"],
)
@pytest.mark.parametrize("trainer", list(TRAINERS))  # the legacy trainer rolls out in the driver and guards its batch
def test_a_misbehaving_reward_function_is_one_line(tmp_path, tiny_model_dir, capsys, fn, code, expected, trainer):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    data = _write_rows(tmp_path / "data.jsonl", ROWS[:8])
    run = tmp_path / "run"
    args = [*_overrides(tiny_model_dir, data, 2, trainer), "data.shuffle=false", f"env.reward_fns=[{rewards}:{fn}]"]
    got, err = _train(run, capsys, *args, "env.reward_timeout_s=1")
    line = _one_error(err)
    assert got == code and expected in line and f"`relayrl train --run-dir {run}` resumes" in line
    assert not list((run / "checkpoints").glob("step_*"))  # the failing first step wrote nothing


def test_a_second_ctrl_c_stops_async_grpo_with_a_hung_reward_function_within_seconds(tmp_path, tiny_model_dir):
    """The producer thread is stuck in the reward function (deadline 600 s): the first Ctrl-C asks for a stop after
    the step, the second stops the process within the CLI's 5 s clean-up deadline, generation process included.
    Asynchronous GRPO runs on the data plane only (refused with `data_plane.enabled=false`); the synchronous
    trainers' reward deadline is `test_a_misbehaving_reward_function_is_one_line`'s, on both."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    data = _write_rows(tmp_path / "data.jsonl", ROWS[:8])
    run = tmp_path / "run"
    argv = [*_overrides(tiny_model_dir, data, 2), "grpo.async_grpo.enabled=true"]
    argv += [f"env.reward_fns=[{rewards}:never_returns]"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run), *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal's Ctrl-C, even in a batch job
    )
    called = Path(f"{rewards}.called")
    deadline = time.monotonic() + 120
    while not called.exists():  # the producer is inside the reward function: the run loop waits for its batch
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.1)
    children = _children(proc.pid)
    assert children  # the generation process (and the resource tracker)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 15 and proc.returncode == 130, err
    lines = [ln for ln in err.splitlines() if ln.startswith("relayrl: interrupted")]
    assert len(lines) == 1 and f"`relayrl train --run-dir {run}` resumes" in lines[0] and "Traceback" not in err
    time.sleep(0.5)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]  # none left behind


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"

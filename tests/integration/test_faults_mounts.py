"""A run directory on a file system that refuses writes (issue 31, item 2): read-only from the start, turned read-only
mid-run, or full. Each `relayrl train` runs in a private mount namespace (`unshare`), where the test may bind the run's
directory read-only or mount a small tmpfs without touching the machine's mounts; a user's reward function turns the
fault on inside step 2, once step 1's checkpoint is published. Exit 2 (at the start) or 1 (mid-run) with one line
naming the path and why, no traceback; step 1's checkpoint intact and the resume point. Where no such namespace can
be made (unprivileged user namespaces off, no `unshare`), the tests skip saying so.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.utils.checkpoint import verify_checkpoint
from tests.helpers import CHECKPOINT_EVERY_STEP, tiny_grpo_overrides

#: Ways into a private mount namespace: as any user (a user namespace maps it to root there), or as root.
NAMESPACES = (("unshare", "--user", "--map-root-user", "--mount"), ("unshare", "--mount"))
#: Binds a directory onto itself read-only and checks it is, then mounts a tmpfs there: what the tests need.
PROBE = 'mount --bind -o ro "$1" "$1" && ! touch "$1/probe" 2>/dev/null && mount -t tmpfs -o size=1m tmpfs "$1"'

REWARDS = """
import os, subprocess

calls = 0


def turns_read_only(prompts, completions, **columns):
    global calls
    calls += 1
    if calls == 2:  # inside step 2: step 1's checkpoint is published
        subprocess.run(["mount", "--bind", "-o", "ro", {where!r}, {where!r}], check=True)
    return [0.0] * len(completions)


def fills_the_disk(prompts, completions, **columns):
    global calls
    calls += 1
    if calls == 2:  # fill the disk, then give back room for the step's metrics lines, not for its checkpoint
        fd = os.open({where!r} + "/filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, bytes(1 << 16)):
                pass
        except OSError:  # ENOSPC: full
            os.ftruncate(fd, os.fstat(fd).st_size - (256 << 10))
        finally:
            os.close(fd)
    return [0.0] * len(completions)
"""


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """The first of `NAMESPACES` in which this user may bind read-only and mount a tmpfs; else the test skips."""
    probe = tmp_path_factory.mktemp("mount_probe")
    why = "`unshare` or `mount` is not installed"
    if shutil.which("unshare") and shutil.which("mount"):
        for prefix in NAMESPACES:
            cmd = [*prefix, "sh", "-c", PROBE, "sh", str(probe)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if proc.returncode == 0:
                return prefix
            why = f"`{shlex.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip() or 'no message'}"
    pytest.skip(f"no private mount namespace to make a read-only or full file system in: {why}")


def _run_args(model_dir: Path, tmp_path: Path, where: Path, fn: str) -> list[str]:
    """A 2-step run checkpointed after every step, scored by `fn` of `REWARDS` (which acts on `where`)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS.format(where=str(where)))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 2?", "answer": str(a + 2)}) + "\n" for a in range(8)))
    return tiny_grpo_overrides(
        model_dir,
        *CHECKPOINT_EVERY_STEP,
        "grpo.max_num_steps=2",
        "logger.flight_recorder.enabled=false",
        "data.train.source=file",
        f"data.train.path={data}",
        f"env.reward_fns=[{rewards}:{fn}]",
    )


def _train_cmd(run: Path, args: list[str], out: Path, name: str) -> str:
    """`relayrl train` as a shell command whose stderr and exit code land in `out/name.err` and `out/name.rc`."""
    cmd = shlex.join([sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run), *args])
    return f"{cmd} 2> {shlex.quote(str(out / name))}.err; echo $? > {shlex.quote(str(out / name))}.rc"


def _in_namespace(namespace: tuple[str, ...], script: str) -> None:
    proc = subprocess.run([*namespace, "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def _result(out: Path, name: str) -> tuple[int, str]:
    """The exit code and the one `relayrl: error:` line of the command `name` (no traceback, no other line)."""
    err = (out / f"{name}.err").read_text()
    lines = [ln for ln in err.splitlines() if ln.startswith("relayrl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return int((out / f"{name}.rc").read_text()), lines[0]


def test_a_run_directory_turned_read_only_mid_run_and_started_on_again(namespace, tiny_model_dir, tmp_path):
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir(), out.mkdir()
    run = disk / "run"
    args = _run_args(tiny_model_dir, tmp_path, disk, "turns_read_only")
    script = "; ".join(
        [
            _train_cmd(run, args, out, "mid_run"),  # step 2's reward function binds `disk` read-only
            _train_cmd(run, [], out, "again"),  # resuming it, still read-only
            _train_cmd(disk / "new", args, out, "new"),  # a new run directory there
        ]
    )
    _in_namespace(namespace, script)

    code, line = _result(out, "mid_run")
    assert code == 1 and f"the checkpoint of step 2 could not be written to {run}/checkpoints/tmp_step_2" in line
    assert "(read-only file system; " in line and "MiB free there" in line and "stays the resume point" in line
    code, line = _result(out, "again")
    assert code == 2 and line == f"relayrl: error: cannot write in {run}/.owner.lock: Read-only file system"
    code, line = _result(out, "new")
    assert code == 2 and line == f"relayrl: error: cannot write in {disk}/new: Read-only file system"

    # nothing lost: step 1's checkpoint and metrics are whole, and where the directory is writable again it resumes
    assert [p.name for p in (run / "checkpoints").glob("*step_*")] == ["step_1"]
    assert verify_checkpoint(run / "checkpoints" / "step_1") is None
    steps = [json.loads(row)["step"] for row in (run / "metrics.jsonl").read_text().splitlines()]  # every line whole
    assert steps[0] == 1 and set(steps) == {1, 2}  # step 2's went through the file opened before; it is run again
    assert main(["train", "--run-dir", str(run)]) == 0
    assert verify_checkpoint(run / "checkpoints" / "step_2") is None


def test_a_full_disk_under_the_checkpoint_writer_is_said_in_plain_words(namespace, tiny_model_dir, tmp_path):
    """The run lives on a 16 MiB tmpfs that step 2's reward function fills but for room for the step's metrics:
    torch's writer fails on the optimizer state with words of its own ("unexpected pos ..."); the line says the disk
    is full. The tmpfs goes with the namespace, so the run is copied out for the checks. (A disk that fills before
    the metrics line is `tests/unit/utils/test_logger.py`'s: one line naming metrics.jsonl.)"""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir(), out.mkdir()
    run = disk / "run"
    args = _run_args(tiny_model_dir, tmp_path, disk, "fills_the_disk")
    mount = f"mount -t tmpfs -o size=16m tmpfs {shlex.quote(str(disk))}"
    copy_out = f"cp -a {shlex.quote(str(run))} {shlex.quote(str(out / 'run'))}"
    _in_namespace(namespace, f"{mount} && {{ {_train_cmd(run, args, out, 'full')}; {copy_out}; }}")

    code, line = _result(out, "full")
    assert code == 1 and f"the checkpoint of step 2 could not be written to {run}/checkpoints/tmp_step_2/" in line
    assert "(no space left on device; 0 MiB free there)" in line and "unexpected pos" not in line
    kept = out / "run" / "checkpoints"
    assert [p.name for p in kept.glob("*step_*")] == ["step_1"]  # the failed write's files removed
    assert verify_checkpoint(kept / "step_1") is None

"""A run directory on a file system that refuses writes (issue 31, item 2): read-only from the start, turned read-only
mid-run, or full. The `relayrl train` commands run in one Python process in a private mount namespace (`unshare`),
where the test may bind a directory read-only or mount a small tmpfs without touching the machine's mounts; a user's
reward function turns the fault on inside step 2, once step 1's checkpoint is published. Each fault: exit 2 (at the
start) or 1 (mid-run) with one line naming the path and why, no traceback; step 1's checkpoint intact and the resume
point. Where no such namespace can be made (unprivileged user namespaces off, no `unshare`), the tests skip saying so.
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
    if not (shutil.which("unshare") and shutil.which("mount")):
        pytest.skip("no private mount namespace to make a read-only or full file system in: no `unshare` or `mount`")
    why = []
    for prefix in NAMESPACES:
        proc = subprocess.run(
            [*prefix, "sh", "-c", PROBE, "sh", str(probe)], capture_output=True, text=True, timeout=60
        )
        if proc.returncode == 0:
            return prefix
        why.append(f"`{shlex.join(prefix)}`: exit {proc.returncode}, {proc.stderr.strip() or 'no message'}")
    pytest.skip(f"no private mount namespace to make a read-only or full file system in: {'; '.join(why)}")


def _run_args(model_dir: Path, files: Path, where: Path, fn: str) -> list[str]:
    """A 2-step run checkpointed after every step, scored by `fn` of `REWARDS` (acting on `where`), its reward module
    and data written into `files`."""
    files.mkdir()
    rewards = files / f"{fn}.py"  # a module of its own per run: the two runs share one process
    rewards.write_text(REWARDS.format(where=str(where)))
    data = files / "data.jsonl"
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


#: `relayrl train` commands run in one Python process (one import of torch for them all), each command's stderr (fd 2,
#: whatever writes it) and exit code landing in `OUT/NAME.err` and `OUT/NAME.rc`. Args: OUT, then [[NAME, ARGV], ...].
CLI_CALLS = """
import json, os, sys
from relayrl.cli.main import main
for name, argv in json.loads(sys.argv[2]):
    with open(os.path.join(sys.argv[1], name + ".err"), "w") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            code = main(argv)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
    with open(os.path.join(sys.argv[1], name + ".rc"), "w") as rc:
        rc.write(str(code))
"""


@pytest.fixture(scope="module")
def faulted(namespace: tuple[str, ...], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's commands, run once: in `ro/` a run whose directory turns read-only in step 2, started on again,
    and a new run there; in `full/` (a 16 MiB tmpfs, gone with the namespace: copied out to `out/full_run`) a run
    whose disk fills in step 2. Returns the root holding `ro/`, `full/` and `out/`."""
    root = tmp_path_factory.mktemp("faults_mounts")
    ro, full, out = root / "ro", root / "full", root / "out"
    for d in (ro, full, out):
        d.mkdir()
    read_only = _run_args(tiny_model_dir, root / "ro_files", ro, "turns_read_only")
    calls = [
        (
            "full",
            [
                "train",
                "--run-dir",
                str(full / "run"),
                *_run_args(tiny_model_dir, root / "full_files", full, "fills_the_disk"),
            ],
        ),
        ("mid_run", ["train", "--run-dir", str(ro / "run"), *read_only]),  # step 2 binds `ro` read-only
        ("again", ["train", "--run-dir", str(ro / "run")]),  # resuming it, still read-only
        ("new", ["train", "--run-dir", str(ro / "new"), *read_only]),  # a new run directory there
    ]
    mount = f"mount -t tmpfs -o size=16m tmpfs {shlex.quote(str(full))}"
    copy_out = f"cp -a {shlex.quote(str(full / 'run'))} {shlex.quote(str(out / 'full_run'))}"
    cli = shlex.join([sys.executable, "-c", CLI_CALLS, str(out), json.dumps(calls)])
    proc = subprocess.run(
        [*namespace, "sh", "-c", f"{mount} && {{ {cli}; {copy_out}; }}"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return root


def _result(out: Path, name: str) -> tuple[int, str]:
    """The exit code and the one `relayrl: error:` line of the command `name` (no traceback, no other line)."""
    err = (out / f"{name}.err").read_text()
    lines = [ln for ln in err.splitlines() if ln.startswith("relayrl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return int((out / f"{name}.rc").read_text()), lines[0]


def test_a_run_directory_turned_read_only_mid_run_and_started_on_again(faulted):
    ro, out = faulted / "ro", faulted / "out"
    run = ro / "run"
    code, line = _result(out, "mid_run")
    assert code == 1 and f"the checkpoint of step 2 could not be written to {run}/checkpoints/tmp_step_2" in line
    assert "(read-only file system; " in line and "MiB free there" in line and "stays the resume point" in line
    code, line = _result(out, "again")
    assert code == 2 and line == f"relayrl: error: cannot write in {run}/.owner.lock: Read-only file system"
    code, line = _result(out, "new")
    assert code == 2 and line == f"relayrl: error: cannot write in {ro}/new: Read-only file system"

    # nothing lost: step 1's checkpoint and metrics are whole, and where the directory is writable again it resumes
    assert [p.name for p in (run / "checkpoints").glob("*step_*")] == ["step_1"]
    assert verify_checkpoint(run / "checkpoints" / "step_1") is None
    steps = [json.loads(row)["step"] for row in (run / "metrics.jsonl").read_text().splitlines()]  # every line whole
    assert steps[0] == 1 and set(steps) == {1, 2}  # step 2's went through the file opened before; it is run again
    assert main(["train", "--run-dir", str(run)]) == 0
    assert verify_checkpoint(run / "checkpoints" / "step_2") is None


def test_a_full_disk_under_the_checkpoint_writer_is_said_in_plain_words(faulted):
    """Step 2's reward function fills the tmpfs but for room for the step's metrics lines: torch's writer fails on
    the optimizer state with words of its own ("unexpected pos ..."); the line says the disk is full. (A disk that
    fills before the metrics line is `tests/unit/utils/test_logger.py`'s: one line naming metrics.jsonl.)"""
    run = faulted / "full" / "run"
    code, line = _result(faulted / "out", "full")
    assert code == 1 and f"the checkpoint of step 2 could not be written to {run}/checkpoints/tmp_step_2/" in line
    assert "(no space left on device; 0 MiB free there)" in line and "unexpected pos" not in line
    kept = faulted / "out" / "full_run" / "checkpoints"
    assert [p.name for p in kept.glob("*step_*")] == ["step_1"]  # the failed write's files removed
    assert verify_checkpoint(kept / "step_1") is None

"""One live run per directory (`relayrl.utils.dir_lock`): a second `relayrl train` on a run directory (or on a
shared checkpoint directory) another live process owns exits 2 with one line naming that process, before any model
loads; a lock left by a dead process is taken over silently."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.utils.dir_lock import LOCK_FILE, DirectoryInUseError, acquire_dir_lock, lock_run_directories

_HOLD = (
    "import sys, time; from relayrl.utils.dir_lock import lock_run_directories; "
    "held = lock_run_directories(sys.argv[1] or None, sys.argv[2] or None); print('ready', flush=True); "
    "time.sleep(300)"
)
_TRY = "import sys; from relayrl.utils.dir_lock import lock_run_directories; lock_run_directories(None, sys.argv[1])"


def _holder(run_dir: Path, checkpoint_dir: Path | None = None) -> subprocess.Popen[str]:
    """Another process owning the directories the way a live `relayrl train` does (its set-up's first call: the
    run directory and the checkpoint directory, by default `<run>/checkpoints`)."""
    ckpts = checkpoint_dir or run_dir / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir), str(ckpts)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, float]:
    start = time.perf_counter()
    code = main(["train", *argv])
    return code, capsys.readouterr().err.strip(), time.perf_counter() - start


def test_second_train_on_a_busy_run_dir_exits_2_naming_the_holder(capsys, tmp_path, holders, monkeypatch) -> None:
    run = tmp_path / "run"
    holders.append(proc := _holder(run))
    # Nothing may load before the check: a tokenizer or model load would fail this test.
    import relayrl.algorithms.setup as setup_mod

    monkeypatch.setattr(setup_mod, "load_tokenizer", lambda cfg: pytest.fail("tokenizer loaded before the check"))
    code, err, elapsed = _train(capsys, "--run-dir", str(run), "grpo.max_num_steps=2")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"relayrl: error: run directory {run} is in use by pid {proc.pid} on ")
    assert "(started 20" in err and err.endswith("; wait for it or use another --run-dir")
    assert elapsed < 10.0
    assert run.is_dir() and (run / LOCK_FILE).is_file()  # the live run's directory is left alone


def test_a_shared_checkpoint_dir_is_refused_too(capsys, tmp_path, holders) -> None:
    shared = tmp_path / "shared_ckpts"
    holders.append(proc := _holder(tmp_path / "other_run", shared))
    run = tmp_path / "run"
    code, err, _ = _train(capsys, "--run-dir", str(run), f"checkpointing.checkpoint_dir={shared}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"checkpoint directory {shared} is in use by pid {proc.pid} on " in err
    assert err.endswith("wait for it or set another checkpointing.checkpoint_dir")
    assert not run.exists()  # this run's own, new directory is not left behind


def test_setup_takes_the_lock_before_anything_loads(tmp_path, holders, monkeypatch) -> None:
    """The library path (no CLI): `run_training` refuses with the same line before the tokenizer loads, and keeps
    the other run's directory even when it did not exist yet as this run started (two runs started at once)."""
    import relayrl.algorithms.setup as setup_mod
    from relayrl.config import MasterConfig

    run = tmp_path / "run"
    real = setup_mod.lock_run_directories

    def race(run_dir, checkpoint_dir):  # the other run creates and takes the directory just before this one
        holders.append(_holder(run_dir))
        return real(run_dir, checkpoint_dir)

    monkeypatch.setattr(setup_mod, "lock_run_directories", race)
    monkeypatch.setattr(setup_mod, "load_tokenizer", lambda cfg: pytest.fail("tokenizer loaded before the check"))
    with pytest.raises(setup_mod.SetupError) as caught:
        setup_mod.run_training(MasterConfig(), run)
    assert str(caught.value).startswith(f"run directory {run} is in use by pid {holders[0].pid} on ")
    assert (run / LOCK_FILE).is_file() and f"pid {holders[0].pid} " in (run / LOCK_FILE).read_text()


def test_another_runs_default_checkpoint_dir_is_refused(capsys, tmp_path, holders) -> None:
    """A second run pointing checkpointing.checkpoint_dir at a live run's own checkpoints: refused at once."""
    first = tmp_path / "first"
    holders.append(proc := _holder(first))
    code, err, _ = _train(
        capsys, "--run-dir", str(tmp_path / "second"), f"checkpointing.checkpoint_dir={first}/checkpoints"
    )
    assert code == 2 and f"checkpoint directory {first}/checkpoints is in use by pid {proc.pid} on " in err


def test_setup_owns_the_default_checkpoint_dir_from_its_first_step(tmp_path, monkeypatch) -> None:
    """By the time anything loads, set-up holds `<run>/checkpoints` as well as the run directory: another run
    naming it as its checkpoint directory is refused (not this run, later, when its checkpointer starts)."""
    import relayrl.algorithms.setup as setup_mod
    from relayrl.config import MasterConfig

    run = tmp_path / "run"

    def probe(cfg: object) -> None:
        other = subprocess.run([sys.executable, "-c", _TRY, str(run / "checkpoints")], capture_output=True, text=True)
        assert (
            other.returncode != 0
            and f"checkpoint directory {run / 'checkpoints'} is in use by pid {os.getpid()} " in other.stderr
        )
        raise ValueError("stopped after the check")

    monkeypatch.setattr(setup_mod, "load_tokenizer", probe)
    with pytest.raises(setup_mod.SetupError, match="stopped after the check"):
        setup_mod.run_training(MasterConfig(), run)
    assert not run.exists()  # a failed set-up still leaves no run directory behind


def test_the_lock_of_a_dead_run_is_taken_over_silently(tmp_path, holders) -> None:
    run = tmp_path / "run"
    holders.append(proc := _holder(run))
    with pytest.raises(DirectoryInUseError):
        lock_run_directories(run, None)
    os.kill(proc.pid, signal.SIGKILL)  # as a crash or kill -9 would end it: the kernel drops its flock
    proc.wait(timeout=30)
    assert f"pid {proc.pid}" in (run / LOCK_FILE).read_text()  # the file stays, naming the dead holder
    (lock,) = lock_run_directories(run, None)
    assert (run / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")
    lock.release()


def test_a_lock_file_naming_a_dead_pid_does_not_block(tmp_path) -> None:
    """A lock file whose recorded process is gone (or never locked it) is just a file: the run proceeds."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text("pid 999999 on elsewhere (started 2020-01-01 00:00:00)\n")
    locks = lock_run_directories(run, tmp_path / "ckpts")
    assert [lock.directory for lock in locks] == [run, tmp_path / "ckpts"]
    for lock in locks:
        lock.release()


def test_holds_in_one_process_are_shared_and_released_with_the_last(tmp_path) -> None:
    a = acquire_dir_lock(tmp_path, "run directory", "use another --run-dir")
    b = acquire_dir_lock(tmp_path, "run directory", "use another --run-dir")
    probe = [sys.executable, "-c", _HOLD, str(tmp_path), ""]
    a.release()
    assert subprocess.run(probe, capture_output=True, text=True, timeout=60).returncode != 0  # b still holds it
    b.release()
    b.release()  # idempotent
    proc = subprocess.Popen(probe, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()
        proc.wait(timeout=30)

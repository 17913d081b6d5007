"""A deadline ends a training run the way every fault does (issue 28 item 5): one line on stderr naming what did
not finish, the deadline and the key that sets it, the command that resumes, exit code 1.

The unit tests make each kind of wait hang for real and check its line (tests/unit/utils/test_deadlines.py and the
modules next to each wait; docs/design.md lists them); this is the one end-to-end run: two local ranks whose
construction cannot finish within a `cluster.call_timeout_s` of 10 ms."""

from __future__ import annotations

import re
from pathlib import Path

from relayrl.cli.main import main
from tests.helpers import tight_deadlines, tiny_grpo_overrides


def test_a_run_past_a_deadline_exits_1_with_one_line_and_the_resume_command(
    tmp_path: Path, tiny_model_dir: Path, capsys, monkeypatch
) -> None:
    tight_deadlines(monkeypatch)  # the run configures its own; the test's process gets its deadlines back after
    run = tmp_path / "run"
    overrides = tiny_grpo_overrides(tiny_model_dir, "cluster.workers_per_node=2", "cluster.call_timeout_s=0.01")
    assert main(["train", "--run-dir", str(run), *overrides]) == 1
    # the ranks' model loading goes on in the background and may draw its progress bar: only relayrl's lines count
    err = [line[line.index("relayrl: ") :] for line in capsys.readouterr().err.splitlines() if "relayrl: " in line]
    assert len(err) == 1, err
    assert re.fullmatch(
        r"relayrl: error: local executor ranks \[[01, ]+\] of 2 in 'building TQPolicyWorker' did not finish within "
        rf"0\.01s \(cluster\.call_timeout_s\); `relayrl train --run-dir {re.escape(str(run))}` resumes from the last "
        r"checkpoint",
        err[0],
    ), err[0]

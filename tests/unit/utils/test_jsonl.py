"""JSON-lines files after a crash mid-append: the partial last line is dropped (and cut before appending again)
with one warning; damage before the end is named by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.config import LoggerConfig
from relayrl.utils.jsonl import JsonlError, read_jsonl, repair_tail
from relayrl.utils.logger import Logger

ROWS = [{"step": 1, "train/loss": 0.5}, {"step": 2, "train/loss": 0.25}]


def _write(path: Path, tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + tail)
    return path


def test_a_partial_last_line_is_dropped_with_one_warning(tmp_path, capsys):
    path = _write(tmp_path / "m.jsonl", '{"step": 3, "train/lo')
    assert read_jsonl(path) == ROWS
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"relayrl: warning: {path}: dropped a partial last line (21 bytes; the writer stopped mid-line)"]


def test_a_whole_last_row_without_its_newline_is_kept(tmp_path, capsys):
    path = _write(tmp_path / "m.jsonl", '{"step": 3}')
    assert read_jsonl(path) == [*ROWS, {"step": 3}] and capsys.readouterr().err == ""


def test_damage_before_the_end_names_the_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "tra\n{"step": 3}\n')
    with pytest.raises(JsonlError, match=rf"^{path} line 2 is not a JSON object \(damaged file\)"):
        read_jsonl(path)


@pytest.mark.parametrize(
    ("tail", "expected", "warned"),
    [("", "", False), ('{"step": 3, "tr', "", True), ('{"step": 3}', '{"step": 3}\n', False)],
    ids=["whole", "partial", "missing_newline"],
)
def test_repair_before_appending(tmp_path, capsys, tail, expected, warned):
    path = _write(tmp_path / "m.jsonl", tail)
    assert repair_tail(path) is bool(tail)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in ROWS) + expected
    assert ("dropped a partial last line" in capsys.readouterr().err) is warned
    assert repair_tail(tmp_path / "absent.jsonl") is False


def test_a_resumed_logger_starts_its_rows_on_a_line_of_their_own(tmp_path, capsys):
    _write(tmp_path / "metrics.jsonl", '{"step": 3, "train/lo')
    with Logger(LoggerConfig(tensorboard_enabled=False, progress_bar=False), tmp_path) as logger:
        logger.log_metrics({"loss": 0.125}, 3, prefix="train")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [*ROWS, {"step": 3, "train/loss": 0.125}]

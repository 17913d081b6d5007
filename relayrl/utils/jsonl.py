"""JSON-lines files that survive a crash mid-append: read tolerantly, repaired before appending again.

Every relayrl writer appends whole lines (`json.dumps(row) + "\\n"` in one write), so the only damage a crash can
leave is a partial *last* line, without its newline. Readers drop such a tail with one warning; a writer that reopens
the file for appending (a resumed run) first cuts it off (or, when the tail is a complete row that only lacks its
newline, completes it), so the next row starts on a line of its own. A line that does not parse anywhere else is
not a crash's trace but damage: `JsonlError` names the file and the line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


class JsonlError(ValueError):
    """A JSON-lines file with a damaged line before its end (one line naming the file and line number)."""


def read_jsonl(path: str | Path, *, warn: bool = True) -> list[dict[str, Any]]:
    """The rows of `path`; a partial last line (no newline, not a JSON object) is dropped with a warning on
    stderr. A damaged line elsewhere, or one that is not a JSON object, raises `JsonlError`."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    rows: list[dict[str, Any]] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        row = _parse(raw)
        if row is None:
            raise JsonlError(f"{path} line {number} is not a JSON object (damaged file); repair or remove that line")
        rows.append(row)
    if tail.strip():
        row = _parse(tail)
        if row is not None:
            rows.append(row)
        elif warn:
            _warn(f"{path}: dropped a partial last line ({len(tail)} bytes; the writer stopped mid-line)")
    return rows


def repair_tail(path: str | Path) -> bool:
    """Make `path` end on a complete line before it is appended to: a partial last line is cut off (one warning
    on stderr), a complete last row without its newline gets one. True when the file was changed."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size == 0:
        return False
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return False
        start = _last_line_start(f, size)
        f.seek(start)
        tail = f.read()
        if _parse(tail) is not None:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        else:
            f.truncate(start)
            _warn(f"{path}: dropped a partial last line ({len(tail)} bytes) left by a run that stopped mid-write")
        f.flush()
        os.fsync(f.fileno())
    return True


def _last_line_start(f: Any, size: int) -> int:
    """Offset just past the last newline of the open file (0 when it has none)."""
    block = 1 << 16
    end = size
    while end > 0:
        start = max(0, end - block)
        f.seek(start)
        chunk = f.read(end - start)
        found = chunk.rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return row if isinstance(row, dict) else None


def _warn(message: str) -> None:
    print(f"relayrl: warning: {message}", file=sys.stderr, flush=True)

"""`relayrl export-rollouts RUN_DIR --step N [--out FILE]`: a recorded step's conversations as JSONL of
OpenAI-style chat messages, one sample a line: `{"messages": [...], "reward": ..., "sample_key": ...}`.

The messages come from the recording's `turns` column (`relayrl.experience.flight_recorder.turn_records`): the
prompt as the environment began it, each reply (with `tool_calls`, arguments as a JSON string, when its calls
ran), each tool result as a `tool` message naming its tool; plain environment observations are `user` messages.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from relayrl.cli.common import fail


def add_parser(sub: Any) -> None:
    e = sub.add_parser(
        "export-rollouts", help="write a recorded step's conversations as JSONL of OpenAI-style chat messages"
    )
    e.add_argument("run_dir")
    e.add_argument("--step", type=int, required=True)
    e.add_argument("--out", help="output file (default: RUN_DIR/rollouts/step_NNNNNN.jsonl); - for stdout")
    e.set_defaults(handler=run)


def chat_messages(turns: list[dict[str, Any]], row: int = 0) -> list[dict[str, Any]]:
    """OpenAI-style messages of one recorded conversation (`turns`: its turn records); `row` makes call ids unique."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the calls the next tool turn answers
    for t, turn in enumerate(turns):
        role = turn["role"]
        if role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": turn["content"]}
            calls = turn.get("tool_calls") or []
            pending = [f"call_{row}_{t}_{k}" for k in range(len(calls))]
            if calls:
                message["tool_calls"] = [
                    {
                        "id": i,
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                    }
                    for i, c in zip(pending, calls)
                ]
            out.append(message)
        elif "messages" in turn:  # the prompt as the environment began it; a tool turn's messages as rendered
            tools = iter(pending)
            for m in turn["messages"]:
                message = {"role": m["role"], "content": m["content"]}
                if m.get("name"):
                    message["name"] = m["name"]
                if m["role"] == "tool":
                    call_id = next(tools, None)
                    if call_id is not None:
                        message["tool_call_id"] = call_id
                out.append(message)
            pending = []
        elif role in ("system", "user"):
            out.append({"role": role, "content": turn["content"]})
        elif turn["content"]:  # a plain observation, fed to the model as text
            out.append({"role": "user", "content": turn["content"]})
    return out


def step_conversations(table: Any) -> list[dict[str, Any]]:
    """One `{"messages", "reward", "sample_key"}` dict per recorded row; ValueError when the step has no turns."""
    if "turns" not in table.column_names:
        raise ValueError("this recording has no 'turns' column (recorded before relayrl kept conversations)")
    cols = {name: table.column(name).to_pylist() for name in ("turns", "reward_env", "sample_key")}
    return [
        {"messages": chat_messages(json.loads(turns), i), "reward": reward, "sample_key": key}
        for i, (turns, reward, key) in enumerate(zip(cols["turns"], cols["reward_env"], cols["sample_key"]))
    ]


def run(args: argparse.Namespace) -> int:
    from relayrl.data_plane.recorder import ROLLOUTS_DIR, read_step, step_path

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        return fail(f"run directory does not exist: {run_dir}")
    try:
        rows = step_conversations(read_step(run_dir / ROLLOUTS_DIR, args.step))
    except (FileNotFoundError, ValueError) as exc:
        return fail(f"{exc}")
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if args.out == "-":
        print(text, end="")
        return 0
    out = Path(args.out) if args.out else step_path(run_dir / ROLLOUTS_DIR, args.step).with_suffix(".jsonl")
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        return fail(f"cannot write {out}: {exc.strerror or exc}")
    print(f"wrote {len(rows)} conversations of step {args.step} to {out}")
    return 0

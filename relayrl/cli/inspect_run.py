"""`relayrl inspect RUN_DIR --step N [--worst K | --best K]`: a recorded step's samples in the terminal.

Per sample: prompt and completion (a multi-turn conversation turn by turn: role, token span, tool calls with their
arguments, tool results), reward components (environment reward, the reward after shaping that the
advantages used, the group's baseline and std), advantage, and the completion tokens where the policy's log-prob
(previous-policy pass; the reference pass when the run skipped it) and the generation engine's disagree most.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from relayrl.cli.common import fail


def add_parser(sub: Any) -> None:
    i = sub.add_parser("inspect", help="print a recorded step's samples (prompt, completion, rewards, advantage)")
    i.add_argument("run_dir")
    i.add_argument("--step", type=int, required=True)
    order = i.add_mutually_exclusive_group()
    order.add_argument("--worst", type=int, metavar="K", help="the K samples of lowest advantage")
    order.add_argument("--best", type=int, metavar="K", help="the K samples of highest advantage")
    i.add_argument("--tokens", type=int, default=3, help="disagreeing tokens shown per sample (default 3)")
    i.set_defaults(handler=run)


def row_advantage(value: Any, mask: list[int] | None) -> float:
    """A row's advantage: the per-row value, or the mean over its loss tokens when recorded per token."""
    if not isinstance(value, list):
        return float(value)
    picked = [v for v, m in zip(value, mask or [1] * len(value)) if m]
    return sum(picked) / len(picked) if picked else 0.0


def disagreements(policy: list[float], generation: list[float], mask: list[int], k: int) -> list[tuple[int, float]]:
    """(token position, policy − generation log-prob) of the `k` loss tokens that disagree most."""
    gaps = [(i, p - g) for i, (p, g, m) in enumerate(zip(policy, generation, mask)) if m]
    return sorted(gaps, key=lambda t: -abs(t[1]))[:k]


def step_samples(table: Any, tokens: int) -> tuple[list[dict[str, Any]], str | None]:
    """One dict per recorded row with what `inspect` prints; and which pass the policy log-probs came from."""
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    source = next((c for c in ("prev_logprobs", "reference_policy_logprobs") if c in cols), None)
    rows = []
    for i in range(table.num_rows):
        mask = cols["token_mask"][i]
        gaps = disagreements(cols[source][i], cols["generation_logprobs"][i], mask, tokens) if source else []
        rows.append(
            {
                "row": i,
                "key": cols["sample_key"][i],
                "prompt": cols["prompt"][i],
                "completion": cols["completion"][i],
                "reward_env": cols["reward_env"][i],
                "reward": cols["reward"][i],
                "baseline": cols["baseline"][i] if "baseline" in cols else None,  # GRPO only
                "std": cols["std"][i] if "std" in cols else None,
                "components": _components(cols["env_metadata"][i]) if "env_metadata" in cols else {},
                "advantage": row_advantage(cols["advantages"][i], mask),
                "gaps": [(pos, cols["input_ids"][i][pos], gap) for pos, gap in gaps],
                "turns": json.loads(cols["turns"][i]) if "turns" in cols else [],
            }
        )
    return rows, source


def run(args: argparse.Namespace) -> int:
    from relayrl.data_plane.recorder import ROLLOUTS_DIR, read_step

    run_dir = Path(args.run_dir)
    try:
        table = read_step(run_dir / ROLLOUTS_DIR, args.step)
    except (FileNotFoundError, ValueError) as exc:  # not recorded, or damaged (RecordingDamagedError names it)
        return fail(str(exc))
    rows, source = step_samples(table, args.tokens)
    if args.worst is not None or args.best is not None:
        rows.sort(key=lambda r: r["advantage"], reverse=args.best is not None)
        rows = rows[: args.worst if args.worst is not None else args.best]
    decode = _decoder(run_dir)
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    label = {"prev_logprobs": "policy", "reference_policy_logprobs": "reference (the run skipped the policy pass)"}
    which = label.get(source or "", "policy")
    console.print(f"[bold]{escape(str(run_dir))} step {args.step}[/bold]: {len(rows)} of {table.num_rows} samples")
    for r in rows:
        gaps = ", ".join(f"{decode(tok)!r}@{pos} {gap:+.3g}" for pos, tok, gap in r["gaps"]) or "-"
        group = "" if r["baseline"] is None else f"group baseline {r['baseline']:.4g} ± {r['std']:.4g}  "
        console.print(
            f"[bold]row {r['row']}[/bold]  advantage [bold]{r['advantage']:+.4g}[/bold]  "
            f"reward env {r['reward_env']:.4g} / shaped {r['reward']:.4g}  {group}[dim]{escape(r['key'])}[/dim]"
        )
        if r["components"]:  # reward functions: each one's value for this row
            console.print("  reward components: " + ", ".join(f"{k} {v}" for k, v in r["components"].items()))
        if _multi_turn(r["turns"]):
            console.print("  conversation:")
            for line in conversation_lines(r["turns"]):
                console.print("    " + escape(line))
        else:
            console.print(f"  prompt:     {escape(r['prompt'])}")
            console.print(f"  completion: [cyan]{escape(r['completion'])}[/cyan]")
        console.print(f"  largest {which} − generation log-prob gaps: {escape(gaps)}")
    return 0


def _multi_turn(turns: list[dict[str, Any]]) -> bool:
    return sum(t["role"] == "assistant" for t in turns) > 1 or any(t["role"] == "tool" for t in turns)


def conversation_lines(turns: list[dict[str, Any]]) -> list[str]:
    """A recorded conversation, a line per turn (role, token span, text) and per tool call (name, arguments, result)."""
    lines = []
    for t in turns:
        flags = "".join(f" ({k})" for k, v in (t.get("flags") or {}).items() if v)
        text = t["content"] if t["role"] != "tool" or "results" not in t else ""
        lines.append(f"{t['role']} [{t['start']}:{t['end']}]{flags}: {text}".rstrip())
        for call in t.get("tool_calls") or []:
            lines.append(f"  call {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})")
        for res in t.get("results") or []:
            lines.append(
                f"  {res['name']} -> {res['content']}" + ("" if res["status"] == "ok" else f" ({res['status']})")
            )
    return lines


def _components(env_metadata: str | None) -> dict[str, Any]:
    """The per-function rewards a reward-function environment put in the row's metadata (else none)."""
    meta = json.loads(env_metadata) if env_metadata else None
    return dict(meta.get("reward_components") or {}) if isinstance(meta, dict) else {}


def _decoder(run_dir: Path) -> Any:
    """Token id -> text with the run's tokenizer; the id itself when the tokenizer cannot be loaded."""
    try:
        from relayrl.algorithms.setup import load_tokenizer
        from relayrl.utils.config_io import load_config

        tokenizer = load_tokenizer(load_config(run_dir / "config.yaml"))
        return lambda tok: tokenizer.decode([tok])
    except Exception:  # noqa: BLE001 - printing ids is the fallback, not an error
        return lambda tok: f"<{tok}>"

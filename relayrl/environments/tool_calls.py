"""Tools of an environment class: their schemas, reading the model's calls, running them concurrently.

A tool is every public method of the class (no leading underscore; `reset`, `get_reward` and `close` excepted) with
type hints and a Google-style docstring: its JSON schema comes from `transformers.utils.get_json_schema`, the
format chat templates take as `tools=`. A public method the schema cannot be made of is refused when the class is
loaded (one line: document it, or make it private), not when the model first calls it.

Calls are read by a parser: `hermes` (the Qwen2.5 / Hermes templates' `<tool_call>{json}</tool_call>`) or a user
function. Calls of a batch run at once, one daemon thread each (async methods run to completion in their thread),
each with a deadline: a hung tool costs its deadline and is reported to the model as timed out, never the run.
A row's own calls run in order, one round per position, since they may depend on each other.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Public methods of an environment class that are part of the contract, not tools.
NOT_TOOLS = frozenset({"reset", "get_reward", "close"})

ToolCallParser = Callable[[str], list[dict[str, Any]]]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_schemas(cls: type) -> dict[str, dict[str, Any]]:
    """{tool name: JSON schema} of `cls`'s public methods; ValueError naming a method the schema cannot be made of."""
    from transformers.utils import get_json_schema

    out: dict[str, dict[str, Any]] = {}
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in NOT_TOOLS or not callable(getattr(cls, name, None)):
            continue
        try:
            out[name] = get_json_schema(getattr(cls, name))
        except Exception as exc:  # no docstring, an undocumented or unhinted argument
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(
                f"{cls.__name__}.{name} is a public method, so a tool, but has no usable schema ({first}); give it type "
                "hints and a Google-style docstring with an Args section, or make it private (_" + name + ")"
            ) from None
    return out


def parse_hermes(text: str) -> list[dict[str, Any]]:
    """Calls in `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, in order; ValueError when a block
    is unclosed or not such a JSON object (`arguments` may also be a JSON string of the object)."""
    found = _CALL.findall(text)
    if text.count("<tool_call>") != len(found) or text.count("</tool_call>") != len(found):
        raise ValueError("unbalanced <tool_call> tags")
    return [_check_call(json_object(body)) for body in found]


def json_object(body: str) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call is not valid JSON ({exc.msg})") from None


def _check_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError('a tool call must be a JSON object with a string "name"')
    args = call.get("arguments", {})
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(args, dict):
        raise ValueError(f'tool call {call["name"]!r}: "arguments" must be a JSON object')
    return {"name": call["name"], "arguments": args}


class ServerError(RuntimeError):
    """A tool's environment server failed (connection, timeout, error reply): not the model's mistake, so it is not
    returned to the model as the tool's result; the rollout ends the run or the episode (`env.on_server_error`)."""


@dataclass
class CallResult:
    """What one tool call gave: the text returned to the model, and how it went."""

    text: str
    status: str  # "ok", "error" (raised), "timeout", "server_error" (raised ServerError)
    latency_s: float


@dataclass
class ToolJob:
    """One call to run: the environment instance, the tool's name and its arguments."""

    target: Any
    name: str
    arguments: dict[str, Any]


def run_calls(jobs: list[list[ToolJob]], timeout_s: float) -> list[list[CallResult]]:
    """Run every row's calls (`jobs[r]`, in order within the row, rows concurrently); results in the same shape."""
    results: list[list[CallResult]] = [[] for _ in jobs]
    for position in range(max((len(j) for j in jobs), default=0)):
        rows = [r for r, row_jobs in enumerate(jobs) if position < len(row_jobs)]
        for r, result in zip(rows, _run_round([jobs[r][position] for r in rows], timeout_s)):
            results[r].append(result)
    return results


def _run_round(jobs: list[ToolJob], timeout_s: float) -> list[CallResult]:
    slots: list[CallResult | None] = [None] * len(jobs)
    done = [threading.Event() for _ in jobs]
    start = time.monotonic()

    def work(k: int) -> None:
        job = jobs[k]
        t0 = time.monotonic()
        try:
            value = _call(job)
            slots[k] = CallResult(_as_text(value), "ok", time.monotonic() - t0)
        except ServerError as exc:  # the environment's server: the rollout decides (env.on_server_error)
            slots[k] = CallResult(str(exc), "server_error", time.monotonic() - t0)
        except Exception as exc:  # the tool's failure is the model's observation
            slots[k] = CallResult(f"Error: {type(exc).__name__}: {exc}", "error", time.monotonic() - t0)
        finally:
            done[k].set()

    for k in range(len(jobs)):
        threading.Thread(target=work, args=(k,), daemon=True, name=f"relayrl-tool-{jobs[k].name}").start()
    out = []
    for k, job in enumerate(jobs):
        finished = done[k].wait(max(0.0, start + timeout_s - time.monotonic()))
        result = slots[k]
        if not finished or result is None:  # still running: its thread is left to end on its own
            result = CallResult(f"Error: tool {job.name!r} timed out after {timeout_s:g} s", "timeout", timeout_s)
        out.append(result)
    return out


def _call(job: ToolJob) -> Any:
    method = getattr(job.target, job.name)
    if inspect.iscoroutinefunction(method):
        return asyncio.run(method(**job.arguments))
    value = method(**job.arguments)
    if inspect.isawaitable(value):
        return asyncio.run(_await(value))
    return value


async def _await(value: Any) -> Any:
    return await value


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)

"""Reward functions in the style users already write for TRL: `f(prompts, completions, **columns) -> list[float]`.

A `RewardFunctionEnvironment` scores one batch of single-turn rows by calling every function once with aligned
lists: the rows' prompts (as the dataset gave them: text, or a list of messages), the completions (the generated
text) and every other dataset column as a keyword argument (a column a row lacks reads None there). A row's reward
is the weighted sum of the functions' values (a None value counts 0: "does not apply to this row"); each
function's batch mean is reported as `reward/<name>`, and each row's values go back in its metadata as
`reward_components` (recorded by the flight recorder).

A function that raises ends the run with `RewardFunctionError`, one line naming the function and the dataset row:
the batch is re-scored row by row to find the first row that fails, so the line points at real data. Exiting
(`sys.exit`, `SystemExit`, a `KeyboardInterrupt` the function raised itself) is such a failure too, and so is a call
that outlives `env.reward_timeout_s`. A NaN value is a non-finite reward like inf (the trainer's `non_finite` policy
applies); None is "does not apply to this row" and counts 0.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from relayrl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog
from relayrl.utils.signals import DeadlineExceeded, call_with_deadline, forced_stop

RewardFn = Callable[..., Sequence[float | None]]


class RewardFunctionError(RuntimeError):
    """A user reward function raised or returned something unusable; the message is one line naming it and the row."""


def reward_fn_name(fn: Callable[..., Any]) -> str:
    """The name a function is logged under: its `__name__` (a `functools.partial` shows its function's)."""
    inner = getattr(fn, "func", fn)
    return str(getattr(inner, "__name__", type(inner).__name__))


def load_reward_fn(entry: str, key: str | None = None, kind: str = "function") -> RewardFn:
    """`module:function` (imported; the working directory is searched too) or `path/to/file.py:function`.
    `key` and `kind` name the setting and the object in errors (environment classes and tool-call parsers load
    the same way)."""
    module_name, _, attr = entry.rpartition(":")
    key = key or f"env.reward_fns entry {entry!r}"
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise ValueError(f"{key}: file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"relayrl_reward_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ValueError(f"{key}: importing {path} failed ({type(exc).__name__}: {exc})") from None
    else:
        added = "" not in sys.path and "." not in sys.path
        if added:  # `relayrl train` from a directory holding rewards.py: `rewards:fn` finds it
            sys.path.append("")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise ValueError(f"{key}: no module named {exc.name!r} (is it on PYTHONPATH?)") from None
        except Exception as exc:
            raise ValueError(f"{key}: importing {module_name} failed ({type(exc).__name__}: {exc})") from None
        finally:
            if added:
                sys.path.remove("")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key}: {module_name} has no {kind} {attr!r}")
    return fn


def named_reward_fns(fns: Sequence[RewardFn]) -> list[tuple[str, RewardFn]]:
    """(unique name, function) pairs; a repeated name gets `_2`, `_3`, ... so every function logs apart."""
    out: list[tuple[str, RewardFn]] = []
    seen: dict[str, int] = {}
    for fn in fns:
        if not callable(fn):
            raise ValueError(f"reward_fns: {fn!r} is not callable; pass functions f(prompts, completions, **columns)")
        name = reward_fn_name(fn)
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name}_{seen[name]}", fn))
    return out


class RewardFunctionEnvironment(EnvironmentInterface):
    """Single-turn scoring by a weighted sum of reward functions; every row terminates after one answer."""

    def __init__(
        self, fns: Sequence[RewardFn], weights: Sequence[float] | None = None, timeout_s: float | None = None
    ) -> None:
        if not fns:
            raise ValueError("task 'reward_fns' needs at least one reward function (env.reward_fns or reward_fns=)")
        self.fns = named_reward_fns(fns)
        if weights is not None and len(weights) != len(self.fns):
            raise ValueError(f"{len(weights)} reward weights for {len(self.fns)} reward functions; give one each")
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(self.fns)
        self.timeout_s = timeout_s  # per function call on a batch (env.reward_timeout_s)
        self._sums = {name: 0.0 for name, _ in self.fns}  # per function: sum and count of its values since
        self._counts = {name: 0 for name, _ in self.fns}  # the last `rollout_metrics`

    def fork(self, fork: Callable[[EnvironmentInterface], EnvironmentInterface]) -> EnvironmentInterface:
        """The same functions with counters of their own (`reward/<name>` of another thread's rollouts)."""
        twin = copy.copy(self)
        twin._sums, twin._counts = dict.fromkeys(self._sums, 0.0), dict.fromkeys(self._counts, 0)
        return twin

    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        """Call every function once on the batch; reward = weighted sum, observation `Reward: <r>`."""
        n = len(message_log_batch)
        if n != len(metadata):
            raise ValueError(f"reward-function env got {n} message logs but {len(metadata)} metadata rows")
        metas = [m or {} for m in metadata]
        prompts = [m.get("prompt", _first_user_text(log)) for m, log in zip(metas, message_log_batch)]
        completions = [
            "".join(str(msg.get("content") or "") for msg in log if msg.get("role") == "assistant")
            for log in message_log_batch
        ]
        names = list(dict.fromkeys(k for m in metas for k in (m.get("columns") or {})))
        columns = {k: [(m.get("columns") or {}).get(k) for m in metas] for k in names}
        total = torch.zeros(n, dtype=torch.float64)  # [B]
        components: list[dict[str, float | None]] = [{} for _ in range(n)]  # per row: function -> its value
        for (name, fn), weight in zip(self.fns, self.weights):
            values = self._call(name, fn, prompts, completions, columns, metas)
            for row, v in zip(components, values):
                row[name] = v
            for v in values:
                if v is not None and not math.isnan(v):
                    self._sums[name] += v
                    self._counts[name] += 1
            # None counts 0; NaN stays NaN, so the trainer's non-finite guard sees it (as it sees inf)
            total += weight * torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float64)  # [B]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Reward: {r:.3f}"} for r in total.tolist()],
            # each function's value rides with the row (the flight recorder's env_metadata, `relayrl inspect`)
            metadata=[{**(m or {}), "reward_components": c} for m, c in zip(metadata, components)],
            next_stop_strings=[None] * n,
            rewards=total.to(torch.float32),  # [B]
            terminateds=torch.ones(n, dtype=torch.bool),  # [B]
        )

    def _call(
        self,
        name: str,
        fn: RewardFn,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        metas: list[dict[str, Any]],
    ) -> list[float | None]:
        """One function's values for the batch; a failure is located to its first failing row."""
        n = len(completions)
        try:
            what = f"reward function {name!r} (env.reward_timeout_s)"
            values = _check_values(
                call_with_deadline(lambda: fn(prompts, completions, **columns), self.timeout_s, what), n
            )
        except DeadlineExceeded:
            raise RewardFunctionError(
                f"reward function {name!r} did not return within env.reward_timeout_s={self.timeout_s:g} s on a batch "
                f"of {n} rows (from {_row_label(metas[0], 0) if metas else 'no row'}); fix it, or raise the deadline"
            ) from None
        except _FAILURES as exc:
            if isinstance(exc, KeyboardInterrupt) and forced_stop():
                raise  # the user's second Ctrl-C, not the function's failure
            row = self._failing_row(fn, prompts, completions, columns)
            where = _row_label(metas[row], row) if row is not None else f"a batch of {n} rows"
            raise RewardFunctionError(f"reward function {name!r} failed on {where}: {_describe(exc)}") from exc
        return values

    def _failing_row(
        self, fn: RewardFn, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
    ) -> int | None:
        """The first row on which `fn`, called on that row alone, raises or returns something unusable."""
        for i in range(len(completions)):
            try:
                row = {k: [v[i]] for k, v in columns.items()}
                one = call_with_deadline(
                    lambda i=i, row=row: fn([prompts[i]], [completions[i]], **row),
                    self.timeout_s,
                    f"reward function {getattr(fn, '__name__', 'of env.reward_fns')!r} (env.reward_timeout_s)",
                )
                _check_values(one, 1)
            except DeadlineExceeded:
                return i
            except _FAILURES as exc:
                if isinstance(exc, KeyboardInterrupt) and forced_stop():
                    raise
                return i
        return None

    def rollout_metrics(self) -> dict[str, float]:
        """`reward/<name>`: each function's mean value over the rows scored since the last call (then reset)."""
        out = {f"reward/{name}": self._sums[name] / self._counts[name] for name in self._sums if self._counts[name]}
        self._sums = dict.fromkeys(self._sums, 0.0)
        self._counts = dict.fromkeys(self._counts, 0)
        return out

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """Mean reward over the batch."""
        rewards = torch.as_tensor(batch["rewards"] if "rewards" in batch else batch["total_reward"])  # [B]
        n = rewards.shape[0]
        return batch, {"reward_mean": rewards.float().mean().item() if n else 0.0, "num_problems_in_batch": n}


#: What a reward function's call may end with that is its own failure (exiting included), not the process's.
_FAILURES = (Exception, SystemExit, KeyboardInterrupt)


def _check_values(values: Any, n: int) -> list[float | None]:
    """A function's return as floats (None kept: "does not apply"); anything but one number (or None) per row is an
    error."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"returned {type(values).__name__}, not a list of {n} floats") from None
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions")
    out: list[float | None] = []
    for v in values:
        if v is None:
            out.append(None)
        elif not isinstance(v, int | float) and not hasattr(v, "__float__"):
            raise TypeError(f"returned a {type(v).__name__} ({v!r}) where a float was expected")
        else:
            out.append(float(v))
    return out


def _describe(exc: BaseException) -> str:
    """`Type: first line`; an exit says so, with its code."""
    if isinstance(exc, SystemExit):
        return f"it exited (SystemExit, code {exc.code!r}); a reward function must return its values"
    if isinstance(exc, KeyboardInterrupt):
        return "it raised KeyboardInterrupt"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _row_label(meta: dict[str, Any], i: int) -> str:
    row = meta.get("row")
    return f"dataset row {row}" if row is not None else f"batch row {i}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "(no message)"


def _first_user_text(log: MessageLog) -> str:
    return next((str(m.get("content") or "") for m in log if m.get("role") == "user"), "")

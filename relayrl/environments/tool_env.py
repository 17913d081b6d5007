"""TRL-style environment classes (`environment_factory`) as a relayrl environment.

The user writes a class; one instance plays one rollout:

- `reset(**row) -> str | None` receives the dataset row's columns (and `prompt`) as keyword arguments (only those
  it names, unless it takes `**kwargs`); text it returns is appended to the first user message;
- every public method with type hints and a docstring is a tool (`tool_calls.tool_schemas`), offered to the model
  through the chat template's `tools=`;
- the optional `get_reward() -> float` is read when the episode ends and added to the reward functions' weighted
  sum (functions get the batch's instances as `environments=`, as in TRL).

Each turn the reply is parsed for tool calls; the calls run (concurrently across the batch, with a deadline) and
their results go back as `tool` messages; a reply without a call ends the episode. A tool that raises returns its
error text to the model; a malformed call or an unknown tool returns a parse error and flags the message
`is_invalid_tool_call` (penalised by `grpo.invalid_tool_call_advantage`). Counts are logged as `env/...`.
An exception in the class's constructor, `reset` or `get_reward` ends the run (`EnvironmentClassError`, one line
naming the class and the dataset row). An instance whose `done` attribute is true after its calls ends the episode
once their results are appended. A served environment's failure (`ServerError` from `reset` or a tool; a tool call
past its deadline on a class with `served_by`) ends the run (`on_server_error="fail"`), or ends the episode without
asking `get_reward` and counts it (`"count"`, `env/server_errors`). Instances are `close()`d when their episode ends.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    EpisodeEnd,
    EpisodeStart,
    Message,
    MessageLog,
)
from relayrl.environments.reward_fn_env import RewardFunctionEnvironment
from relayrl.environments.tool_calls import (
    ServerError,
    ToolCallParser,
    ToolJob,
    parse_hermes,
    run_calls,
    tool_schemas,
)

log = logging.getLogger(__name__)

#: Counters reported per rollout (then reset), as `<prefix>/<name>`.
COUNTERS = (
    "episodes",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "invalid_tool_calls",
    "tool_latency_s",
    "server_errors",
)


class EnvironmentClassError(RuntimeError):
    """The user's environment class raised in its constructor, `reset` or `get_reward` (one line naming it and
    the dataset row)."""


class ServedEnvironmentError(EnvironmentClassError):
    """A served environment's server failed with `env.on_server_error=fail` (one line naming it and the row)."""


def _first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for the one-line errors of the user's code."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or ['(no message)'])[0]}"


@dataclass
class _Episode:
    env: Any
    where: str  # "dataset row N" / "batch row N", for errors
    failed: str | None = None  # the server failure that ended it (on_server_error="count")


class ToolEnvironment(EnvironmentInterface):
    """Runs rollouts of one environment class; rows carry their episode's id in their metadata (`episode`)."""

    def __init__(
        self,
        factory: type,
        *,
        reward_fns: RewardFunctionEnvironment | None = None,
        parser: ToolCallParser = parse_hermes,
        tool_timeout_s: float = 60.0,
        template_kwargs: dict[str, Any] | None = None,
        metric_prefix: str = "env",
        on_server_error: str = "fail",
        source: Callable[[], type] | None = None,
    ) -> None:
        if not callable(factory):
            raise ValueError(f"environment_factory {factory!r} is not a class (or callable making an environment)")
        self.factory = factory
        self.name = getattr(factory, "__name__", type(factory).__name__)
        given = getattr(factory, "relayrl_tools", None)  # a served environment's schemas come from its server's Action
        self.schemas = dict(given) if given is not None else tool_schemas(factory) if isinstance(factory, type) else {}
        self.tools = list(self.schemas.values()) or None
        self.reward_fns = reward_fns
        self.parser = parser
        self.tool_timeout_s = tool_timeout_s
        self.template_kwargs = dict(template_kwargs or {})
        self.metric_prefix = metric_prefix
        if on_server_error not in ("fail", "count"):
            raise ValueError(f"env.on_server_error must be 'fail' or 'count', got {on_server_error!r}")
        self.on_server_error = on_server_error
        self.served_by = getattr(factory, "served_by", None)
        #: How another process gets the class: loads it again (a configured `file.py:Class` / `module:Class`, a
        #: served environment's config); None sends the class itself (cloudpickle: by value from `__main__`).
        self.source = source
        self._fresh_state()

    def _fresh_state(self) -> None:
        self._episodes: dict[int, _Episode] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0.0)

    # ------------------------------------------------------------------ shipping (a Ray rollout actor)
    def __getstate__(self) -> dict[str, Any]:
        """The settings and the class (or its `source`), without live episodes, lock or counts: what a Ray
        rollout actor builds its own copy from before any episode starts."""
        with self._lock:
            if self._episodes:
                raise TypeError(f"environment class {self.name} has live episodes; it is sent before the rollouts")
        skip = ("_episodes", "_ids", "_lock", "_counts") + (("factory",) if self.source is not None else ())
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.source is not None:
            self.factory = self.source()  # e.g. the file loaded again, in this process
        self._fresh_state()

    def fork(self, fork: Callable[[EnvironmentInterface], EnvironmentInterface]) -> EnvironmentInterface:
        """The same class and settings with episodes and counters of their own (and its reward functions forked)."""
        twin = object.__new__(type(self))  # not copy.copy: that would pickle (reload a file class) via __getstate__
        twin.__dict__.update(self.__dict__)
        scorer = None if self.reward_fns is None else fork(self.reward_fns)
        assert scorer is None or isinstance(scorer, RewardFunctionEnvironment)
        twin.reward_fns = scorer
        twin._fresh_state()
        return twin

    # ------------------------------------------------------------------ episodes
    def start_episodes(self, metadata: list[dict[str, Any] | None]) -> list[EpisodeStart]:
        """One instance per row, reset with the row's columns; the prompt conversation gains the text it returns."""
        starts = []
        for k, meta in enumerate(metadata):
            meta = dict(meta or {})
            where = f"dataset row {meta['row']}" if meta.get("row") is not None else f"batch row {k}"
            env = self._user_call(self.factory, "()", where)
            try:
                text, failed = self._reset(env, meta, where)
            except BaseException:  # the run ends: the instance (a served session) is closed first
                _close(_Episode(env, where))
                raise
            with self._lock:
                episode = next(self._ids)
                self._episodes[episode] = _Episode(env, where, failed)
            messages = [dict(m) for m in meta.get("messages") or [{"role": "user", "content": str(meta.get("prompt"))}]]
            if text:
                first = next((m for m in messages if m["role"] == "user"), messages[-1])
                first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
            self._counts["episodes"] += 1
            starts.append(EpisodeStart(messages, self.tools, self.template_kwargs, {**meta, "episode": episode}))
        return starts

    def _reset(self, env: Any, meta: dict[str, Any], where: str) -> tuple[str | None, str | None]:
        """(text for the first prompt, the server failure that already ended the episode) of a fresh instance."""
        reset = getattr(env, "reset", None)  # optional: a class without one starts every episode as it is
        try:
            text = self._user_call(reset, ".reset", where, **_reset_kwargs(reset, meta)) if callable(reset) else None
        except EnvironmentClassError as exc:
            if not isinstance(exc.__cause__, ServerError):
                raise
            return None, self._server_failure(where, str(exc.__cause__))
        if text is not None and not isinstance(text, str):
            raise EnvironmentClassError(
                f"{self.name}.reset returned a {type(text).__name__} on {where}; return a str or None"
            )
        return text, None

    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        """Run the tool calls of every reply; a reply without calls ends its episode with its final reward."""
        n = len(message_log_batch)
        metas = [dict(m or {}) for m in metadata]
        episodes = [self._episode(m) for m in metas]
        observations: list[Message] = [{"role": "environment", "content": ""} for _ in range(n)]
        flags: list[dict[str, bool]] = [{} for _ in range(n)]
        jobs: list[list[ToolJob]] = [[] for _ in range(n)]
        finished: list[int] = []
        for r, log in enumerate(message_log_batch):
            if episodes[r].failed:  # its server failed before: the episode ends now
                finished.append(r)
                continue
            reply = next((str(m.get("content") or "") for m in reversed(log) if m.get("role") == "assistant"), "")
            try:
                calls = self.parser(reply)
                unknown = [c["name"] for c in calls if c["name"] not in self.schemas]
                if unknown:
                    raise ValueError(f"unknown tool {unknown[0]!r}; tools: {', '.join(self.schemas) or 'none'}")
            except ValueError as exc:
                self._counts["invalid_tool_calls"] += 1
                flags[r] = {"is_invalid_tool_call": True}
                observations[r] = _chat([{"role": "tool", "content": f"Error: {exc}"}])
                continue
            except Exception as exc:  # a bug in the parser, not a malformed call (those raise ValueError)
                raise EnvironmentClassError(
                    f"tool-call parser {getattr(self.parser, '__qualname__', self.parser)!r} failed on "
                    f"{episodes[r].where}: {_first_line(exc)} (env.tool_call_parser; raise ValueError "
                    "for a malformed call)"
                ) from exc
            if not calls:
                finished.append(r)
                continue
            jobs[r] = [ToolJob(episodes[r].env, c["name"], c["arguments"]) for c in calls]
        results = run_calls(jobs, self.tool_timeout_s)
        for r, row_results in enumerate(results):
            if not row_results:
                continue
            tool_messages, calls = [], []
            lost = next((res for res in row_results if self._lost(res.status)), None)
            if lost is not None:  # the server failed: no observation, the episode ends (or the run, on "fail")
                episodes[r].failed = self._server_failure(episodes[r].where, lost.text)
                finished.append(r)
                continue
            for job, res in zip(jobs[r], row_results):
                self._counts["tool_calls"] += 1
                self._counts["tool_latency_s"] += res.latency_s
                self._counts["tool_errors"] += res.status == "error"
                self._counts["tool_timeouts"] += res.status == "timeout"
                tool_messages.append({"role": "tool", "name": job.name, "content": res.text})
                calls.append(
                    {"name": job.name, "arguments": job.arguments, "status": res.status, "latency_s": res.latency_s}
                )
            observations[r] = {**_chat(tool_messages), "calls": calls}  # what ran, for the flight recorder
            if getattr(episodes[r].env, "done", False):  # the environment ended the episode (e.g. a server's done)
                finished.append(r)
        rewards = torch.zeros(n, dtype=torch.float32)  # [B]
        terminated = torch.zeros(n, dtype=torch.bool)  # [B]
        if finished:
            end = self._finish([message_log_batch[r] for r in finished], [metas[r] for r in finished])
            rewards[finished] = end.rewards
            terminated[finished] = True
            for r, meta in zip(finished, end.metadata):
                metas[r] = meta or {}
        return EnvironmentReturn(
            observations=observations,
            metadata=list(metas),
            next_stop_strings=[None] * n,
            rewards=rewards,
            terminateds=terminated,
            message_flags=flags,
        )

    def end_episodes(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EpisodeEnd:
        """Final rewards of episodes the rollout stopped (turn limit, sequence budget)."""
        return self._finish(message_log_batch, [dict(m or {}) for m in metadata])

    def _finish(self, logs: list[MessageLog], metas: list[dict[str, Any]]) -> EpisodeEnd:
        """`get_reward()` plus the reward functions (given `environments=`), then release the instances."""
        episodes = [self._episode(m) for m in metas]
        own = [0.0] * len(logs)
        if callable(getattr(self.factory, "get_reward", None)):  # not asked of an episode its server failed
            own = [
                0.0 if ep.failed else float(self._user_call(ep.env.get_reward, ".get_reward", ep.where))
                for ep in episodes
            ]
        total = torch.tensor(own, dtype=torch.float32)  # [B]
        components: list[dict[str, Any]] = [
            {"get_reward": v} if hasattr(self.factory, "get_reward") else {} for v in own
        ]
        if self.reward_fns is not None:
            with_envs = [
                {**m, "columns": {**(m.get("columns") or {}), "environments": ep.env}} for m, ep in zip(metas, episodes)
            ]
            ret = self.reward_fns.step([[_role_content(x) for x in log] for log in logs], with_envs)
            total += ret.rewards.to(torch.float32)
            for parts, meta in zip(components, ret.metadata):
                parts.update((meta or {}).get("reward_components") or {})
        with self._lock:
            for m in metas:
                self._episodes.pop(int(m["episode"]), None)
        for ep in episodes:
            _close(ep)
        # the episode's id is this process's counter: it leaves the row's metadata with the episode (records of a
        # resumed run then equal an uninterrupted run's)
        out = [
            {
                **{k: v for k, v in m.items() if k != "episode"},
                "reward_components": p,
                **({"server_error": ep.failed} if ep.failed else {}),
            }
            for m, p, ep in zip(metas, components, episodes)
        ]
        return EpisodeEnd(total, list(out))

    # ------------------------------------------------------------------ helpers
    def _episode(self, meta: dict[str, Any]) -> _Episode:
        episode = meta.get("episode")
        with self._lock:
            found = self._episodes.get(int(episode)) if episode is not None else None
        if found is None:
            raise RuntimeError(f"{self.name}: a row reached the environment with no live episode ({episode!r})")
        return found

    def _lost(self, status: str) -> bool:
        """A call that shows its server failed: it raised ServerError, or a served environment's call timed out."""
        return status == "server_error" or (status == "timeout" and self.served_by is not None)

    def _server_failure(self, where: str, reason: str) -> str:
        """`on_server_error`: "fail" raises (one line), "count" counts it and returns the reason the episode keeps."""
        server = f"served environment {self.served_by}" if self.served_by else f"environment class {self.name}"
        if self.on_server_error == "fail":
            raise ServedEnvironmentError(
                f"{server} failed on {where}: {reason}; env.on_server_error=count ends the episode instead"
            )
        self._counts["server_errors"] += 1
        log.warning("%s failed on %s: %s; the episode ends (env.on_server_error=count)", server, where, reason)
        return reason

    def shutdown(self) -> None:
        """Close the instances of episodes still open (a run that stopped mid-rollout)."""
        with self._lock:
            live, self._episodes = list(self._episodes.values()), {}
        for ep in live:
            _close(ep)

    def _user_call(self, fn: Any, what: str, where: str, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as exc:
            raise EnvironmentClassError(
                f"environment class {self.name}{what} failed on {where}: {_first_line(exc)}"
            ) from exc

    def rollout_metrics(self) -> dict[str, float]:
        """`<prefix>/<counter>` since the last call (then reset), tool latency as a mean per call, the share of the
        model's calls that parsed (`tool_call_validity`; absent when it made none), and the reward functions'
        `reward/<name>`."""
        c, p = self._counts, self.metric_prefix
        out = {f"{p}/{k}": v for k, v in c.items() if k != "tool_latency_s"}
        out[f"{p}/tool_latency_s"] = c["tool_latency_s"] / c["tool_calls"] if c["tool_calls"] else 0.0
        if c["tool_calls"] + c["invalid_tool_calls"]:
            out[f"{p}/tool_call_validity"] = c["tool_calls"] / (c["tool_calls"] + c["invalid_tool_calls"])
        self._counts = dict.fromkeys(COUNTERS, 0.0)
        if self.reward_fns is not None:
            out.update(self.reward_fns.rollout_metrics())
        return out

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """Mean reward over the batch (as the reward-function environment reports it)."""
        rewards = torch.as_tensor(batch["rewards"] if "rewards" in batch else batch["total_reward"])  # [B]
        n = rewards.shape[0]
        return batch, {"reward_mean": rewards.float().mean().item() if n else 0.0, "num_problems_in_batch": n}


def _close(episode: _Episode) -> None:
    """`close()` an ended episode's instance when it has one (a served environment's session); best effort."""
    close = getattr(episode.env, "close", None)
    if callable(close):
        try:
            close()
        except Exception as exc:  # a session on a server that is gone: nothing left to release
            log.warning("closing the environment of %s failed: %s: %s", episode.where, type(exc).__name__, exc)


def _chat(messages: list[Message]) -> Message:
    """An observation the rollout renders through the chat template (role of the log entry: `tool`)."""
    return {"role": "tool", "content": "", "chat": messages}


def _role_content(message: Message) -> Message:
    return {"role": message["role"], "content": message["content"]}


def _reset_kwargs(reset: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """The row's columns (and `prompt`) as `reset` takes them: all with `**kwargs`, else those it names."""
    row = {**(meta.get("columns") or {})}
    if meta.get("prompt") is not None:
        row.setdefault("prompt", meta["prompt"])
    params = inspect.signature(reset).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return row
    names = {p.name for p in params}
    return {k: v for k, v in row.items() if k in names}

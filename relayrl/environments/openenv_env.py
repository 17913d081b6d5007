"""Served environments: an OpenEnv server (reset / step / state over a WebSocket session) as an environment class.

`openenv_environment(base_url, action)` makes a class for the environment-class slot (`env.openenv`, or
`relayrl.train(environment_factory=...)`). One instance plays one rollout and holds its own session on the server,
opened through the `openenv` package's client (`GenericEnvClient` unless a typed client class is given):

- `reset(**row)` is the server's reset, given the row's columns named in `reset_columns`; the text of the
  observation it returns is appended to the first user message;
- one tool (`tool_name`, default `step`) whose arguments are the server's Action fields (the pydantic schema of
  the Action class, less `metadata`): a call is one `step`; the observation's text is the tool message, its
  reward adds to the episode's, and `done` ends the episode after that message;
- `get_reward()` is the sum of the step rewards; `server_state()` is the server's `state` (for reward functions,
  which receive the instances as `environments=`); `close()` ends the session (the rollout calls it).

A failure of the server itself (refused or lost connection, no reply within `timeout_s`, an error frame) raises
`ServerError`; the rollout then ends the run or the episode, as `env.on_server_error` says. Arguments the Action
class refuses are the model's mistake: their error goes back to it as the tool's result.
"""

from __future__ import annotations

import json
from typing import Any

from relayrl.environments.reward_fn_env import load_reward_fn
from relayrl.environments.tool_calls import NOT_TOOLS, ServerError

#: Observation fields that are the step's outcome, not its text.
OUTCOME_FIELDS = ("done", "reward", "metadata")


def openenv_environment(
    base_url: str,
    action: type | str,
    *,
    client: type | str | None = None,
    tool_name: str = "step",
    observation_field: str | None = None,
    reset_columns: list[str] | tuple[str, ...] = (),
    timeout_s: float = 30.0,
) -> type:
    """An environment class whose instances play episodes on the OpenEnv server at `base_url`.

    `action` is the server's Action class (or its import path), whose fields are the tool's arguments; `client` an
    `EnvClient` subclass (default: openenv's `GenericEnvClient`); `observation_field` names the observation's text
    (default: its only field besides done/reward/metadata, else those fields as JSON)."""
    try:
        from openenv.core import GenericEnvClient
    except ImportError:
        raise ValueError("served environments need the openenv package: pip install 'relayrl[openenv]'") from None

    if tool_name in NOT_TOOLS or not tool_name.isidentifier() or tool_name.startswith("_"):
        raise ValueError(f"openenv tool_name {tool_name!r} must be a public identifier other than {sorted(NOT_TOOLS)}")

    action_cls = (
        load_reward_fn(action, key=f"openenv action {action!r}", kind="class") if isinstance(action, str) else action
    )
    client_cls = GenericEnvClient if client is None else client
    if isinstance(client_cls, str):
        client_cls = load_reward_fn(client_cls, key=f"openenv client {client_cls!r}", kind="class")
    if not hasattr(action_cls, "model_json_schema"):
        raise ValueError(f"openenv action {action_cls!r} is not a pydantic model (an OpenEnv Action class)")
    schema = _tool_schema(action_cls, tool_name)
    columns = tuple(reset_columns)

    class ServedEnvironment:
        __doc__ = f"An episode on the OpenEnv server at {base_url}."
        served_by = base_url
        relayrl_tools = {tool_name: schema}

        def __init__(self) -> None:
            self.client: Any = None
            self.rewards: list[float] = []
            self.done = False

        def reset(self, **row: Any) -> str | None:
            self.client = client_cls(base_url=base_url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s).sync()
            result = _served("reset", lambda: self.client.reset(**{k: row[k] for k in columns if k in row}), timeout_s)
            self._outcome(result)
            return observation_text(result.observation, observation_field) or None

        def act(self, **arguments: Any) -> str:
            try:
                act = action_cls(**arguments)
            except Exception as exc:  # pydantic's ValidationError: the model's arguments, told to the model
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise ValueError(f"invalid arguments for {tool_name!r}: {first}") from None
            result = _served("step", lambda: self.client.step(act), timeout_s)
            self._outcome(result)
            return observation_text(result.observation, observation_field)

        def get_reward(self) -> float:
            return float(sum(self.rewards))

        def server_state(self) -> Any:
            """The server's state of this session (a dict with the generic client, e.g. its step count)."""
            return _served("state", lambda: self.client.state(), timeout_s)

        def close(self) -> None:
            if self.client is not None:
                client, self.client = self.client, None
                client.close()

        def _outcome(self, result: Any) -> None:
            if result.reward is not None:
                self.rewards.append(float(result.reward))
            self.done = bool(result.done)

    setattr(ServedEnvironment, tool_name, ServedEnvironment.act)
    ServedEnvironment.__name__ = ServedEnvironment.__qualname__ = (
        f"OpenEnv[{getattr(action_cls, '__name__', 'Action')}]"
    )
    return ServedEnvironment


def observation_text(observation: Any, field: str | None) -> str:
    """The text of an observation (a pydantic Observation or the generic client's dict)."""
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation or {})
    if field is not None:
        if field not in data:
            raise ServerError(f"the observation has no field {field!r} (fields: {', '.join(sorted(data)) or 'none'})")
        return str(data[field])
    rest = {k: v for k, v in data.items() if k not in OUTCOME_FIELDS}
    if len(rest) == 1:
        return str(next(iter(rest.values())))
    return json.dumps(rest, sort_keys=True, default=str)


def _served(what: str, call: Any, timeout_s: float) -> Any:
    try:
        return call()
    except Exception as exc:  # ConnectionError, TimeoutError, ConnectionClosed, "Server error: ..." frames
        first = (str(exc).strip().splitlines() or [""])[0]
        text = f"{type(exc).__name__}: {first}" if first else f"{type(exc).__name__} (no reply)"
        if _timed_out(exc):  # the deadline, and the key that sets it
            text += f" (no reply within {timeout_s:g}s, env.openenv.timeout_s)"
        raise ServerError(f"{what} failed: {text}") from exc


def _timed_out(exc: BaseException | None) -> bool:
    """A timeout anywhere in the error's chain (the client wraps a handshake's timeout in a ConnectionError)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, TimeoutError) or "timed out" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _tool_schema(action_cls: type, name: str) -> dict[str, Any]:
    """The chat templates' tool schema of an Action class: its fields (less `metadata`) as the parameters."""
    params = dict(action_cls.model_json_schema())  # type: ignore[attr-defined]
    props = {k: v for k, v in (params.get("properties") or {}).items() if k != "metadata"}
    parameters: dict[str, Any] = {"type": "object", "properties": props}
    required = [k for k in params.get("required") or [] if k in props]
    if required:
        parameters["required"] = required
    if "$defs" in params:
        parameters["$defs"] = params["$defs"]
    doc = (action_cls.__doc__ or "").strip().splitlines()
    description = doc[0] if doc else f"Act in the environment ({action_cls.__name__})."
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}

"""Environment registry: the task names a dataset uses map to environments built from `env.*` config."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from relayrl.config import ENVIRONMENT_TASK, REWARD_FNS_TASK, EnvConfig, MasterConfig
from relayrl.environments.interfaces import EnvironmentInterface

EnvFactory = Callable[[EnvConfig], EnvironmentInterface]


def _make_math(cfg: EnvConfig) -> EnvironmentInterface:
    from relayrl.environments.math_env import MathEnvironment  # math-verify is slow to import; load on use

    return MathEnvironment(cfg.math)


def _make_reward_model(cfg: EnvConfig) -> EnvironmentInterface:
    """A learned reward (`env.reward_model`) by task name, beside the verifiers; the classifier code loads on use."""
    if cfg.reward_model is None:
        raise ValueError(
            "task 'reward_model' needs env.reward_model.model_dir (a sequence-classification model directory)"
        )
    from relayrl.environments.reward_model_env import RewardModelEnvironment  # torch-heavy; load on use

    return RewardModelEnvironment.from_config(cfg.reward_model)


def build_reward_fn_env(
    cfg: EnvConfig, given: Sequence[Callable[..., Any]] | None = None
) -> EnvironmentInterface | None:
    """The reward-function environment: `env.reward_fns` (imported here) followed by the functions given in Python
    (`relayrl.train(reward_fns=...)`), weighted by `env.reward_weights`; None when there are none."""
    from relayrl.environments.reward_fn_env import RewardFunctionEnvironment, load_reward_fn

    fns = [load_reward_fn(entry) for entry in cfg.reward_fns] + list(given or [])
    if not fns:
        return None
    weights = cfg.reward_weights
    if weights is not None and len(weights) != len(fns):
        raise ValueError(
            f"env.reward_weights has {len(weights)} weights for {len(fns)} reward functions; give one each"
        )
    return RewardFunctionEnvironment(fns, weights, timeout_s=cfg.reward_timeout_s)


#: Environment classes handed to `relayrl.train(environment_factory=...)`: one class, or {name: class}.
GivenFactories = type | dict[str, type] | None


def build_tool_environments(
    cfg: MasterConfig, given: GivenFactories = None, reward_fns: EnvironmentInterface | None = None
) -> dict[str, EnvironmentInterface]:
    """{task name: ToolEnvironment} for the environment classes of `env.environment_factory` (imported here) or
    given in Python: one class is task `environment`, several are tasks by their names (the rows' `environment`
    column). The reward functions, when any, score every episode with them. ValueError (one line) for a bad path,
    a class with an undocumented public method, or a bad tool-call parser."""
    from relayrl.environments.reward_fn_env import RewardFunctionEnvironment, load_reward_fn
    from relayrl.environments.tool_calls import ToolCallParser, parse_hermes
    from relayrl.environments.tool_env import ToolEnvironment

    configured, env = cfg.env.environment_factory, cfg.env
    if (configured is not None or env.openenv is not None) and given is not None:
        what = "env.environment_factory" if configured is not None else "env.openenv"
        raise ValueError(f"environment classes are given twice: {what} and environment_factory=")
    if configured is None and given is None and env.openenv is None:
        return {}
    factories: dict[str, Any]
    sources: dict[str, Callable[[], type]]  # how a Ray rollout actor loads each class again
    if env.openenv is not None:  # a served environment: its class is made from the server's Action
        from relayrl.environments.openenv_env import openenv_environment

        o = env.openenv
        served = functools.partial(
            openenv_environment,
            o.base_url,
            _absolute(o.action),
            client=None if o.client is None else _absolute(o.client),
            tool_name=o.tool_name,
            observation_field=o.observation_field,
            reset_columns=o.reset_columns,
            timeout_s=o.timeout_s,
        )
        factories, sources = {ENVIRONMENT_TASK: served()}, {ENVIRONMENT_TASK: served}
    elif configured is not None:
        key = "env.environment_factory"
        entries = {ENVIRONMENT_TASK: configured} if isinstance(configured, str) else dict(configured)
        sources = {
            name: functools.partial(load_reward_fn, _absolute(path), key=f"{key} entry {path!r}", kind="class")
            for name, path in entries.items()
        }
        factories = {name: load() for name, load in sources.items()}
    else:  # classes given in Python travel to a Ray rollout actor as they are (cloudpickle)
        factories = dict(given) if isinstance(given, dict) else {ENVIRONMENT_TASK: given}
        sources = {}
    parser: ToolCallParser = parse_hermes
    if env.tool_call_parser != "hermes":
        parser = load_reward_fn(env.tool_call_parser, key=f"env.tool_call_parser {env.tool_call_parser!r}")
    several = len(factories) > 1 or isinstance(configured, dict) or isinstance(given, dict)
    scorer = reward_fns if isinstance(reward_fns, RewardFunctionEnvironment) else None
    return {
        name: ToolEnvironment(
            factory,
            reward_fns=scorer,
            parser=parser,
            tool_timeout_s=env.tool_timeout_s,
            template_kwargs=cfg.policy.tokenizer.chat_template_kwargs,
            metric_prefix=f"env/{name}" if several else "env",
            on_server_error=env.on_server_error,
            source=sources.get(name),
        )
        for name, factory in factories.items()
    }


def _absolute(entry: str) -> str:
    """`file.py:Name` with the file's absolute path (a Ray actor loads it again from another directory); a
    `module:Name` entry as it is."""
    module, sep, attr = entry.rpartition(":")
    return f"{Path(module).expanduser().absolute()}{sep}{attr}" if module.endswith(".py") else entry


def _make_reward_fns(cfg: EnvConfig) -> EnvironmentInterface:
    """User reward functions by import path (`env.reward_fns`); `relayrl.train(reward_fns=...)` builds its own."""
    env = build_reward_fn_env(cfg)
    if env is None:
        raise ValueError(
            f"task {REWARD_FNS_TASK!r} needs reward functions: env.reward_fns=[module:function, ...] "
            "(or reward_fns= in relayrl.train)"
        )
    return env


ENV_REGISTRY: dict[str, EnvFactory] = {
    "math": _make_math,
    "reward_model": _make_reward_model,
    REWARD_FNS_TASK: _make_reward_fns,
}


def register_env(name: str, factory: EnvFactory) -> None:
    """Make `name` usable as a task name; re-registering a name is an error so plugins cannot collide silently."""
    if name in ENV_REGISTRY:
        raise ValueError(f"environment {name!r} is already registered")
    ENV_REGISTRY[name] = factory


def create_env(name: str, cfg: EnvConfig | None = None) -> EnvironmentInterface:
    """Build the environment registered as `name`."""
    if name not in ENV_REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(sorted(ENV_REGISTRY))}")
    return ENV_REGISTRY[name](cfg or EnvConfig())


def create_task_to_env(task_names: Iterable[str], cfg: EnvConfig | None = None) -> dict[str, EnvironmentInterface]:
    """One environment instance per distinct task name, as `run_multi_turn_rollout` expects."""
    return {name: create_env(name, cfg) for name in dict.fromkeys(task_names)}


def fork_environments(task_to_env: dict[str, EnvironmentInterface]) -> dict[str, EnvironmentInterface]:
    """`task_to_env` for rollouts on another thread at the same time (`EnvironmentInterface.fork`): one copy per
    environment object, so tasks (and environment classes) that share one, e.g. the reward functions, share its
    copy as they share it here."""
    copies: dict[int, EnvironmentInterface] = {}

    def fork(env: EnvironmentInterface) -> EnvironmentInterface:
        if id(env) not in copies:
            copies[id(env)] = env.fork(fork)
        return copies[id(env)]

    return {task: fork(env) for task, env in task_to_env.items()}


def shutdown_all(envs: Iterable[EnvironmentInterface]) -> None:
    """`shutdown()` every environment (each object once), even when one of them raises (the first error is raised
    after the rest are shut down): a failed run still closes the instances and sessions of the others."""
    error: BaseException | None = None
    for env in {id(e): e for e in envs}.values():
        try:
            env.shutdown()
        except BaseException as exc:  # noqa: BLE001 - raised below, once the others are shut down
            error = error or exc
    if error is not None:
        raise error


def build_environments(
    cfg: MasterConfig,
    task_names: Iterable[str] = (),
    reward_fns: EnvironmentInterface | None = None,
    given: dict[str, EnvironmentInterface] | None = None,
) -> dict[str, EnvironmentInterface]:
    """Environments for the configured datasets' default tasks plus `task_names` (e.g. a dataset's `task_names`,
    which also covers per-row task fields); every name must be registered or `given` (environment classes, see
    `build_tool_environments`). `reward_fns`, when given, is the environment of task `reward_fns` (functions handed
    to `relayrl.train`, which no config can name).
    """
    names = [cfg.data.train.default_task]
    if cfg.data.validation is not None:
        names.append(cfg.data.validation.default_task)
    names = list(dict.fromkeys([*names, *task_names]))
    envs = {n: given[n] for n in names if n in (given or {})}
    names = [n for n in names if n not in envs]
    if reward_fns is None or REWARD_FNS_TASK not in names:
        return {**envs, **create_task_to_env(names, cfg.env)}
    envs.update(create_task_to_env([n for n in names if n != REWARD_FNS_TASK], cfg.env))
    envs[REWARD_FNS_TASK] = reward_fns
    return envs

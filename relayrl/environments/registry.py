"""Environment registry: the task names a dataset uses map to environments built from `env.*` config."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from relayrl.config import REWARD_FNS_TASK, EnvConfig, MasterConfig
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


def build_environments(
    cfg: MasterConfig, task_names: Iterable[str] = (), reward_fns: EnvironmentInterface | None = None
) -> dict[str, EnvironmentInterface]:
    """Environments for the configured datasets' default tasks plus `task_names` (e.g. a dataset's `task_names`,
    which also covers per-row task fields); every name must be registered. `reward_fns`, when given, is the
    environment of task `reward_fns` (functions handed to `relayrl.train`, which no config can name).
    """
    names = [cfg.data.train.default_task]
    if cfg.data.validation is not None:
        names.append(cfg.data.validation.default_task)
    names = list(dict.fromkeys([*names, *task_names]))
    if reward_fns is None or REWARD_FNS_TASK not in names:
        return create_task_to_env(names, cfg.env)
    envs = create_task_to_env([n for n in names if n != REWARD_FNS_TASK], cfg.env)
    envs[REWARD_FNS_TASK] = reward_fns
    return envs

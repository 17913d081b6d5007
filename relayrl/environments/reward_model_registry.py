"""The `reward_model` task: a learned reward (`env.reward_model`) available by name beside the verifiers.

The factory imports the classifier code only when the task is used, like the math environment's factory, so
registering it costs nothing for runs that never score with a reward model.
"""

from __future__ import annotations

from relayrl.config import EnvConfig
from relayrl.environments.interfaces import EnvironmentInterface
from relayrl.environments.registry import ENV_REGISTRY, register_env

REWARD_MODEL_TASK = "reward_model"


def make_reward_model_env(cfg: EnvConfig) -> EnvironmentInterface:
    """A `RewardModelEnvironment` from `env.reward_model`; a clear error when that block is missing."""
    if cfg.reward_model is None:
        raise ValueError(
            f"task {REWARD_MODEL_TASK!r} needs env.reward_model.model_dir (a sequence-classification model directory)"
        )
    from relayrl.environments.reward_model_env import RewardModelEnvironment

    return RewardModelEnvironment.from_config(cfg.reward_model)


def ensure_reward_model_env_registered() -> None:
    """Register the `reward_model` task unless the registry already knows it (idempotent)."""
    if REWARD_MODEL_TASK not in ENV_REGISTRY:
        register_env(REWARD_MODEL_TASK, make_reward_model_env)

"""Reward environments: the `EnvironmentInterface` contract, the math verifier, the reward-model environment and
the registry that maps a dataset's task names to environments.

Imports allowed: `relayrl.models` (a reward model is a model), data_plane, distributed, utils, config; never
experience or algorithms.
"""

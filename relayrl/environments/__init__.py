"""Reward environments: `interfaces` (the `EnvironmentInterface` contract), `math_env` (the math verifier),
`reward_fn_env` (user reward functions in TRL's style), `reward_model_env` (a learned reward model in place of a
verifier) and `registry` (a dataset's task names -> environments).

Imports allowed: `relayrl.models` (a reward model is a model), data_plane, distributed, utils, config; never
experience or algorithms.
"""

"""Where rollouts come from: datasets and loaders, multi-turn rollouts against environments, the rollout actor
that writes a rollout's bulk into the data plane, and the small wire-form carry it returns to the driver.

Imports allowed: `relayrl.models` (generation interfaces), environments, data_plane, distributed, utils, config;
never algorithms.
"""

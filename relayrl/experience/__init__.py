"""Where rollouts come from: datasets and loaders, multi-turn rollouts against environments, the rollout actor
that writes a rollout's bulk into the data plane, and the small wire-form carry it returns to the driver; `flight_recorder`, the per-sample rows (text, environment
reward) the rollout side records for replay and inspection.

Imports allowed: `relayrl.models` (generation interfaces), environments, data_plane, distributed, utils, config;
never algorithms.
"""

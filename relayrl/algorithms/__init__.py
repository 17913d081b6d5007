"""The algorithms, in two layers.

Math (pure functions on tensors and config values; they import only torch, `relayrl.config` and each other):
`advantages` (GRPO / Reinforce++ estimators, clipping, advantage metrics), `gae` (GAE, PPO estimators, the sharded
whitening the data-plane critic runs), `loss_functions` (clipped policy-gradient losses, KL), `value_loss`,
`logprob_error`, `reward_functions` (scaling, shaping), `utils` (masked statistics, metric aggregation),
`interfaces` (the loss-function contract). `relayrl.models` may import these, never the trainers.

Trainers (may import everything below them: models, experience, environments, data_plane, distributed, utils,
config; never `relayrl.cli`): `runner` (the one outer loop and step tail), `validation`, `setup` (one set-up for
every trainer; `components` the two kinds it builds, typed with their trainers' Protocols), `protocols` (the seams a trainer calls), `trainer_common` (step pieces the trainers share), and the
trainers themselves, each holding only its step phases: `grpo` / `grpo_sync` and `ppo` / `ppo_sync` (legacy and
data-plane, side by side; `dynamic_sampling` is `grpo_sync`'s filter on metadata). A data-plane trainer takes its
rows from a `protocols.RolloutSource`: `rollout_sources` (`ActorSource`, generated for the step),
`producer_source` (`ProducerSource`, made ahead by asynchronous GRPO's producer: `grpo_async` builds it,
`async_rollouts` and `async_state` run and checkpoint the producer) or `replay` (`RecordedSource`). `recording` is the
flight recorder's trainer side; `preflight` the checks run before any model loads; `api` the Python entry point
(`relayrl.train`); `evaluate`, `parity` and `replay` serve the CLI.
"""

"""Where rollouts come from.

`records` where prompts come from (task, file, `datasets`, Python rows), `data` the prompt datasets and loaders,
`chat_render` chat-template rendering (prompts, multi-turn continuations), `arithmetic` the built-in task;
`rollouts` multi-turn rollouts against environments and message-log flattening; `sync_rollout_actor` the rollout
actor that writes a rollout's bulk into the data plane (`ray_rollout` hosts it in a Ray actor), `carry_wire` the
small wire-form carry it returns to the driver; `flight_recorder` the per-sample rows (text, environment reward) the
rollout side records for replay and inspection.

Imports allowed: `relayrl.models` (generation interfaces), environments, data_plane, distributed, utils, config;
never algorithms.
"""

"""The PPO critic: `ValueModel` (an LM backbone plus a scalar head, values right-shifted to token alignment), its
`ValueWorker` (a `ModelWorker`) and façade `Value`; `TQValueWorker` / `TQValue` the data-plane variants, which also
run GAE next to the stored values; `interfaces` the spec's contract.

Imports as for `relayrl.models` (this package builds on `models.worker_base`, `facade_base`, `tq_facade`, `fast`).
"""

"""Generation engines: `HfGeneration` (in-process, over the policy's live module when colocated, decoding through
`models.fast` where it can), `DistributedGeneration` over a group of `GenerationWorker`s kept current by refit,
`ProcessGeneration` (an `HfGeneration` in a child process, so asynchronous GRPO's decoding does not share the
trainer's interpreter lock), `sampling` (top-k / top-p and the inverse-CDF sampler shared by every engine) and
`interfaces` (the spec's contract).

Imports as for `relayrl.models`; generation workers load the network with `models.policy.worker.load_causal_lm`.
"""

"""The trainable models (policy, critic), the generation engines and the machinery they share.

One copy of each mechanism:

- `worker_base`: a data-parallel replica of a trainable model (`ModelWorker`: loading, rank 0's weights broadcast,
  AdamW + LR schedule, the train() loop, micro-batching, train/inference memory phases, checkpoint save/load);
  `optim` the optimizer step and the global-batch loop it runs (over a `TrainingReplica`); `worker_data_plane`
  the store connection a data-plane worker holds (`WorkerDataPlane`) and its entry points (`DataPlaneWorker`).
- `facade_base`: the driver side of such a group (`ModelFacade`: worker group from the `cluster` block, train(),
  memory phases, checkpoints); `tq_facade` the data-plane façade layer (`TQFacade`: holds a `ModelFacade` and
  dispatches by `KVBatchMeta`, the step's partition end, driver reads and writes).
- `policy/` the causal-LM policy, `value/` the PPO critic, each a worker + façade over the shared bases, plus
  their data-plane variants; `generation/` the generation engines; `fast/` the CPU fast path; `tiny` the embedded
  tiny model.
- `microbatch`: sequence packing and dynamic batching (how a rank cuts its rows into micro-batches); `fp8_kv` the
  FP8 KV-cache scale names and arithmetic shared by calibration and generation.

Imports allowed: relayrl.algorithms' pure math modules (advantages, gae, loss_functions, value_loss,
logprob_error, reward_functions, utils, interfaces), relayrl.data_plane, relayrl.distributed, relayrl.utils and
relayrl.config; never the algorithms trainers or setup, never relayrl.experience or relayrl.environments.
Workers are dispatched by method reference (`group.run_sharded(PolicyWorker.train, shards, ...)`).
"""

"""The causal-LM policy: `PolicyWorker` (a `ModelWorker` with the frozen reference copy, next-token log-probs,
top-k logits, the policy loss, FP8 KV-cache calibration and the refit senders) and its façade `Policy`;
`TQPolicyWorker` / `TQPolicy` the data-plane variants; `logprobs` the chunked log-prob math; `interfaces` the
spec's contracts; `lora` the LoRA adapters (`policy.lora`); `reward_model` a frozen sequence classifier that
scores whole sequences.

Imports as for `relayrl.models` (this package builds on `models.worker_base`, `facade_base`, `tq_facade`, `fast`).
"""

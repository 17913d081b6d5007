"""The CPU-friendly fast path of llama-family models: exact re-implementations of the HF forward without its
per-call machinery, for generation and for the policy / reference / critic passes.

- `support`: the one check of which models, dtypes and devices the fast path reproduces (else callers use HF's
  forward), and how it reads a supported model's weight tensors in place.
- `decoder`: the KV-cache decoders behind the generation engine (`FastDecoder`, and `HfDecoder` as the fallback).
- `forward` / `packing`: full-sequence hidden states on packed tokens (padding dropped, shared prefixes computed
  once, only the positions a loss reads); `attention`: their causal attention (a dense form for short bf16 rows on
  the CPU, SDPA elsewhere).
- `kernels` + `csrc/cpu_kernels.cpp`: the optional compiled CPU kernels (decode step, sampler, RMSNorm, RoPE).

Imports allowed here: torch, transformers, relayrl.utils and relayrl.config only, so policy, value and generation
code can all depend on this package without cycles.
"""

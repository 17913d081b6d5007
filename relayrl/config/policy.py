"""The model blocks: `policy` (tokenizer, generation, optimizer, scheduler, data parallelism, sequence packing and
dynamic batching), `loss_fn`, and the critic's `value` / `value_loss_fn`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from relayrl.config.base import BUILTIN_TINY_MODEL, NonNegFloat, NonNegInt, Strict, UnitFloat


# ---------------------------------------------------------------------------------------------------- policy
class TokenizerConfig(Strict):
    name: str | None = None
    """Tokenizer directory; None means `policy.model_name`."""
    chat_template: str | None = None
    """Override the tokenizer's chat template (a Jinja string or a path to a .jinja file)."""


class GenerationResourcesConfig(Strict):
    """Dedicated generation workers (used when generation is not colocated, on the Ray executor)."""

    num_nodes: PositiveInt | None = None
    workers_per_node: PositiveInt | None = None


class ColocatedConfig(Strict):
    enabled: bool = True
    """Generation shares devices (and, on the local executor, the very weights) with training. On Ray: one
    generation worker per policy rank, refit over ZMQ IPC; false: `resources` workers, refit over a collective."""
    resources: GenerationResourcesConfig = GenerationResourcesConfig()


class GenerationConfig(Strict):
    backend: Literal["hf"] = "hf"
    """Generation engine. `hf`: batched sampling with a KV cache through transformers, CPU or GPU."""
    max_new_tokens: PositiveInt = 16
    temperature: PositiveFloat = 1.0
    top_p: UnitFloat = 1.0
    top_k: PositiveInt | None = None
    stop_token_ids: list[int] | None = None
    """None means [eos_token_id]."""
    stop_strings: list[str] | None = None
    colocated: ColocatedConfig = ColocatedConfig()
    native_cpu_decode: bool = True
    """On CPU, run each decode step of a float32 llama-family model as one compiled call (built with the system C++
    compiler on first use, ~15 s, cached under ~/.cache/relayrl); falls back to PyTorch ops when it cannot be built."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """KV-cache storage during generation. `auto`: the model's dtype (float32 on CPU). `fp8`: float8 e4m3
    (torch.float8_e4m3fn, 1 byte per value) holding k / k_scale and v / v_scale per layer, multiplied back on every
    read, on CPU and GPU; the scales are the policy's `calibrate_qkv_fp8_scales` ones, set on the engine with
    `set_kv_scales` and carried by the refit (1.0 until the first ones arrive). Log-probs move by quantization error
    (tests/unit/models/test_fp8_kv.py measures it); the compiled CPU decode step is not used (PyTorch ops instead)."""


class AdamWKwargs(Strict):
    lr: PositiveFloat = 3e-5
    weight_decay: NonNegFloat = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8


class OptimizerConfig(Strict):
    name: Literal["torch.optim.AdamW", "AdamW"] = "torch.optim.AdamW"
    kwargs: AdamWKwargs = AdamWKwargs()


class SchedulerConfig(Strict):
    name: Literal["constant", "cosine"] = "constant"
    """LR after warm-up: constant, or cosine decay to `min_lr_ratio * lr` over `decay_steps`."""
    warmup_steps: NonNegInt = 0
    warmup_start_factor: UnitFloat = 0.1
    decay_steps: PositiveInt | None = None
    """Cosine horizon in scheduler steps (one per train() call); None means grpo.max_num_steps."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0


class DataParallelConfig(Strict):
    """How data-parallel ranks combine gradients (relayrl/distributed/parallelize.py); the reference's
    `dtensor_cfg.enabled` corresponds to `fsdp2`. Results agree across strategies; all normalise over the global batch."""

    strategy: Literal["manual", "ddp", "fsdp2"] = "manual"
    """`manual`: one flat gradient all-reduce before clipping (any executor). `ddp`: DistributedDataParallel.
    `fsdp2`: fully_shard per decoder layer (sharded gradients and optimizer state). ddp/fsdp2 need
    cluster.executor='ray' when there is more than one worker."""


PackingAlgorithm = Literal[
    "concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing"
]


class SequencePackingConfig(Strict):
    """Sequence packing: each data-parallel rank's rows are binned by token count (whole sequences, never split) and
    every bin runs as one packed micro-batch whose sequences attend only to themselves (per-sequence attention,
    positions restarting at 0). Loss, gradients and log-probs equal the unpacked run's to float32 rounding."""

    enabled: bool = False
    """Pack the training, log-prob, reference and top-k passes (policy) or the value passes (value model)."""
    train_mb_tokens: PositiveInt | None = None
    """Token capacity of one training bin; None means max_total_sequence_length x train_micro_batch_size."""
    logprob_mb_tokens: PositiveInt | None = None
    """Token capacity of one log-prob / reference / top-k / value bin; None means max_total_sequence_length x
    logprob_batch_size (or train_micro_batch_size)."""
    algorithm: PackingAlgorithm = "modified_first_fit_decreasing"
    """Bin packer: concatenative (in order), first_fit_decreasing, first_fit_shuffle (seeded by the row count) or
    modified_first_fit_decreasing (Johnson & Garey)."""
    microbatch_order: Literal["packer", "largest_first"] = "packer"
    """Order a rank runs its bins in: as the packer made them, or the largest (most tokens) first."""
    sequence_length_round: PositiveInt = 1
    """Each sequence counts as its length rounded up to this multiple when bins are filled (bin accounting only:
    the packed micro-batch holds the true lengths)."""


class DynamicBatchingConfig(Strict):
    """Dynamic batching: rows sorted by length are grouped into micro-batches under a token budget (rows x padded
    width), each cut to its own width; every data-parallel rank runs the same micro-batch schedule."""

    enabled: bool = False
    """Token-budget micro-batches in the training, log-prob, reference and top-k (or value) passes."""
    train_mb_tokens: PositiveInt | None = None
    """Rows x padded width per training micro-batch; None means max_total_sequence_length x train_micro_batch_size."""
    logprob_mb_tokens: PositiveInt | None = None
    """Rows x padded width per log-prob / reference / top-k / value micro-batch; None means
    max_total_sequence_length x logprob_batch_size (or train_micro_batch_size)."""
    sequence_length_round: PositiveInt = 64
    """Round each micro-batch's width up to this multiple (also the batch-wide padded width on the data plane)."""


def _check_batching(
    section: str, packing: SequencePackingConfig, dynamic: DynamicBatchingConfig, max_length: int
) -> None:
    """At most one mode, and a budget the longest sequence (rounded as the mode rounds it) fits into."""
    if packing.enabled and dynamic.enabled:
        raise ValueError(
            f"{section}.sequence_packing.enabled and {section}.dynamic_batching.enabled are mutually exclusive; "
            "enable at most one"
        )
    for name, block in (("sequence_packing", packing), ("dynamic_batching", dynamic)):
        rounded = -(-max_length // block.sequence_length_round) * block.sequence_length_round
        for key, budget in (("train_mb_tokens", block.train_mb_tokens), ("logprob_mb_tokens", block.logprob_mb_tokens)):
            if block.enabled and budget is not None and budget < rounded:
                raise ValueError(
                    f"{section}.{name}.{key} = {budget} is below {section}.max_total_sequence_length = {max_length} "
                    f"(rounded to {name}.sequence_length_round: {rounded}): the longest sequence would not fit"
                )


class BatchingModes(Strict):
    """The two ways the policy and the value model may cut their passes into micro-batches (at most one on)."""

    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    """Bin whole sequences into packed micro-batches (exclusive with dynamic_batching)."""
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    """Token-budget micro-batches of similar lengths (exclusive with sequence_packing)."""


class LoraConfig(Strict):
    """Low-rank adapters (LoRA, through `peft`, the `lora` extra): the base weights stay frozen and only the adapters
    train, are checkpointed and carry optimizer state; the reference policy is the base model with the adapters off."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight of the policy."""
    rank: PositiveInt = 8
    """Rank r of each adapter pair (A: r x in, B: out x r); the adapter adds r x (in + out) weights per module."""
    alpha: PositiveFloat = 16.0
    """Scaling numerator: an adapter's update B @ A is multiplied by alpha / rank."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on an adapter's input while training (0: none, and training stays deterministic)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (or name suffixes, e.g. [q_proj, v_proj]) that get adapters; `all-linear`: every linear layer of
    the decoder except the output head."""
    init_seed: NonNegInt = 0
    """Seed of the adapters' random start (lora_A; lora_B starts at zero), the same on every executor and rank."""


class PolicyConfig(BatchingModes):
    model_name: str = BUILTIN_TINY_MODEL
    """A local Hugging Face causal-LM directory (or `builtin:tiny-arith`, the shipped model)."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    random_init: bool = False
    """Build the architecture from `model_name`'s config.json with freshly initialised weights."""
    hf_config_overrides: dict[str, Any] = {}
    train_global_batch_size: PositiveInt = 128
    train_micro_batch_size: PositiveInt = 128
    logprob_batch_size: PositiveInt | None = None
    """Rows per logprob / reference / top-k micro-batch; None means train_micro_batch_size."""
    logprob_chunk_size: PositiveInt | None = None
    """Positions per log-softmax chunk; None picks a chunk that keeps [rows, chunk, V] fp32 under ~64 MB."""
    max_total_sequence_length: PositiveInt = 64
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    max_grad_norm: PositiveFloat | None = 1.0
    activation_checkpointing: bool = False
    native_cpu_ops: bool = True
    """On CPU, the policy and reference passes of a float32 llama-family model run RMSNorm and RoPE (forward and
    backward) as relayrl's compiled kernels, the library `generation.native_cpu_decode` builds; else PyTorch ops."""
    make_sequence_length_divisible_by: PositiveInt = 1
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    generation: GenerationConfig = GenerationConfig()
    data_parallel: DataParallelConfig = DataParallelConfig()
    lora: LoraConfig = LoraConfig()
    """Train low-rank adapters instead of the full weights (off by default)."""

    @model_validator(mode="after")
    def _one_batching_mode(self) -> PolicyConfig:
        _check_batching("policy", self.sequence_packing, self.dynamic_batching, self.max_total_sequence_length)
        if self.lora.enabled and self.data_parallel.strategy == "fsdp2":
            raise ValueError(
                "policy.lora.enabled=true does not support policy.data_parallel.strategy=fsdp2 (the sharded replica "
                "would hold frozen and trained weights in one unit); use strategy=manual or ddp"
            )
        if self.lora.enabled and isinstance(self.lora.target_modules, list) and not self.lora.target_modules:
            raise ValueError("policy.lora.target_modules is empty; name modules (e.g. [q_proj, v_proj]) or all-linear")
        return self


# ---------------------------------------------------------------------------------------------------- loss
class ClippedPGLossConfig(Strict):
    reference_policy_kl_penalty: NonNegFloat = 0.02
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: PositiveFloat | None = 20.0
    kl_output_clamp_value: PositiveFloat | None = 10.0
    ratio_clip_min: NonNegFloat = 0.2
    ratio_clip_max: NonNegFloat = 0.2
    ratio_clip_c: Annotated[float, Field(gt=1)] | None = None
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    truncated_importance_sampling_ratio: PositiveFloat | None = None
    truncated_importance_sampling_ratio_min: NonNegFloat | None = None
    sequence_level_importance_ratios: bool = False
    token_level_loss: bool = True
    force_on_policy_ratio: bool = False
    use_kl_in_reward: bool = False
    use_cispo: bool = False
    disable_ppo_ratio: bool = False
    positive_example_nll_weight: NonNegFloat = 0.0


class ValueConfig(BatchingModes):
    """The critic: the policy keys that make sense for a value model (no generation, no reference)."""

    model_name: str = BUILTIN_TINY_MODEL
    """A local HF causal-LM directory, a sequence-classification (reward model) directory, or a saved critic."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    random_init: bool = False
    hf_config_overrides: dict[str, Any] = {}
    train_global_batch_size: PositiveInt = 128
    train_micro_batch_size: PositiveInt = 128
    logprob_batch_size: PositiveInt | None = None
    """Rows per get_values micro-batch; None means train_micro_batch_size."""
    max_total_sequence_length: PositiveInt = 64
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    max_grad_norm: PositiveFloat | None = 1.0
    activation_checkpointing: bool = False
    optimizer: OptimizerConfig = OptimizerConfig(kwargs=AdamWKwargs(lr=1e-4))
    scheduler: SchedulerConfig = SchedulerConfig()
    head_init_std: PositiveFloat | None = None
    """Std of a fresh head's weights; None means the backbone config's initializer_range (as transformers does)."""
    data_parallel: DataParallelConfig = DataParallelConfig()

    @model_validator(mode="after")
    def _one_batching_mode(self) -> ValueConfig:
        _check_batching("value", self.sequence_packing, self.dynamic_batching, self.max_total_sequence_length)
        return self


class MseValueLossConfig(Strict):
    scale: PositiveFloat = 1.0
    value_clip: PositiveFloat | None = None
    """Clip new values to old ± value_clip (PPO's clipped value loss); None disables it."""

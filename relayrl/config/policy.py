"""The model blocks: `policy` (tokenizer, generation, optimizer, scheduler, data parallelism, sequence packing and
dynamic batching), `loss_fn`, and the critic's `value` / `value_loss_fn`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from relayrl.config.base import BUILTIN_TINY_MODEL, NonNegFloat, NonNegInt, Strict, UnitFloat


# ---------------------------------------------------------------------------------------------------- policy
class TokenizerConfig(Strict):
    name: str | None = None
    """Tokenizer directory; None means `policy.model_name`."""
    chat_template: str | None = None
    """Override the tokenizer's chat template (a Jinja string or a path to a .jinja file)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables every prompt rendering passes to the chat template (e.g. `enable_thinking: false` for
    templates that read it); None passes none."""


class GenerationResourcesConfig(Strict):
    """Dedicated generation workers (used when generation is not colocated, on the Ray executor)."""

    num_nodes: PositiveInt | None = None
    """Nodes of dedicated generation workers; must be set (with workers_per_node) when colocated.enabled is false
    on the Ray executor. None: unset (colocated generation)."""
    workers_per_node: PositiveInt | None = None
    """Dedicated generation workers per node; the generation group has num_nodes x workers_per_node ranks.
    None: unset (colocated generation)."""


class ColocatedConfig(Strict):
    enabled: bool = True
    """Generation shares devices (and, on the local executor, the very weights) with training. On Ray: one
    generation worker per policy rank, refit over ZMQ IPC; false: `resources` workers, refit over a collective."""
    resources: GenerationResourcesConfig = GenerationResourcesConfig()
    """The dedicated generation workers used when `enabled` is false (ignored while colocated)."""


class GenerationConfig(Strict):
    backend: Literal["hf"] = "hf"
    """Generation engine. `hf`: batched sampling with a KV cache through transformers, CPU or GPU."""
    max_new_tokens: PositiveInt = 16
    """Most tokens sampled per generation call (one turn); also capped by what max_total_sequence_length leaves
    after the prompt. Must be below policy.max_total_sequence_length."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature: logits are divided by it when sampling and in every training / log-prob / reference /
    top-k pass, so training scores tokens under the distribution they were drawn from."""
    top_p: UnitFloat = 1.0
    """Nucleus sampling: keep the most probable tokens whose mass reaches top_p (1.0: off). When below 1 the
    policy's log-probs are computed under the same filter (the KL term uses unfiltered ones)."""
    top_k: PositiveInt | None = None
    """Sample among the k most probable tokens only; None: no top-k filter. When set, the policy's log-probs are
    computed under the same filter (the KL term uses unfiltered ones)."""
    support_max_tokens: PositiveInt | None = None
    """With top_k or top_p set: most token ids recorded per token for the sampler's own kept set (4 bytes each, every
    stored token), which the log-prob and training passes use as the filter instead of recomputing it from their own
    logits. None: 2 x top_k when top_k is set (room for ties at its boundary), else 64 (top_p alone). A token whose
    kept set is larger is not recorded: the trainer recomputes its filter and counts it in
    train/sampling/support_unrecorded. Must be >= top_k."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a row's generation (the stop token is kept); None means [eos_token_id]."""
    stop_strings: list[str] | None = None
    """Extra stop strings for every row: a row ends once its generated text contains one (merged with the per-row ones
    an environment gives). None: none."""
    colocated: ColocatedConfig = ColocatedConfig()
    """Whether generation shares the training workers (and how to place it when it does not)."""
    native_cpu_decode: bool = True
    """On CPU, run each decode step of a float32 llama-family model as one compiled call (built with the system C++
    compiler once, on first use, cached under ~/.cache/relayrl); falls back to PyTorch ops when it cannot be built."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """KV-cache storage during generation. `auto`: the model's dtype (float32 on CPU). `fp8`: float8 e4m3
    (torch.float8_e4m3fn, 1 byte per value) holding k / k_scale and v / v_scale per layer, multiplied back on every
    read, on CPU and GPU; the trainers calibrate them (`calibrate_qkv_fp8_scales`, include_q) before the first refit
    and after every training step, and the refit carries them to generation. Log-probs move by quantization error
    (tests/unit/models/test_fp8_kv.py measures it); the compiled CPU decode step is not used (PyTorch ops instead)."""
    refit_verify: Literal["enforce", "log", "off"] = "enforce"
    """Check after every refit (and before every generation phase) that generation holds the trainer's weights: each
    side digests its tensors where they live and the digests are compared, a few bytes per tensor, on every path
    (in-process engine and its compute-precision copy, LoRA-merged weights, Ray generation workers, the asynchronous
    producer's snapshot loads, FP8 KV scales). `enforce`: a mismatch fails the step with one line naming the tensor,
    the worker and the weights version; `log`: the line is logged and training goes on; `off`: no check."""
    logprob_error_alarm: Literal["enforce", "log", "off"] = "enforce"
    """A second, independent alarm: the step's generation-vs-training log-prob error (`train/token_mult_prob_error`,
    1.0 when both sides agree) above `logprob_error_bound`. `enforce` fails the step with one line, `log` logs it,
    `off` does not look."""
    logprob_error_bound: Annotated[float, Field(gt=1.0)] = 1.2
    """The bound of `logprob_error_alarm` on the step's mean token_mult_prob_error (mean over tokens of
    exp|log p_gen - log p_train|). On-policy float32 runs sit at 1.0; asynchronous GRPO (staleness 1) and bf16
    generation add a few hundredths; a stale or broken refit goes far above."""

    @field_validator("refit_verify", "logprob_error_alarm", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        """YAML reads an unquoted `off` as false: take it as the mode it spells."""
        return "off" if value is False else value

    @property
    def support_width(self) -> int:
        """Ids recorded per token for the sampler's kept set (`support_max_tokens`, or its default)."""
        if self.support_max_tokens is not None:
            return self.support_max_tokens
        return 2 * self.top_k if self.top_k is not None else 64  # top-p after top-k only shrinks the set

    @model_validator(mode="after")
    def _support_fits_top_k(self) -> GenerationConfig:
        if self.top_k is not None and self.support_max_tokens is not None and self.top_k > self.support_max_tokens:
            raise ValueError(
                f"policy.generation.top_k={self.top_k} > policy.generation.support_max_tokens="
                f"{self.support_max_tokens}: every token's kept set could not be recorded; raise support_max_tokens"
            )
        return self


class AdamWKwargs(Strict):
    lr: PositiveFloat = 3e-5
    """Peak learning rate; the scheduler multiplies it per step (warm-up, cosine decay)."""
    weight_decay: NonNegFloat = 0.0
    """AdamW decoupled weight decay, applied to every trainable parameter (0: none)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW decay rates of the first and second moment estimates."""
    eps: PositiveFloat = 1e-8
    """AdamW term added to the denominator for numerical stability."""


class OptimizerConfig(Strict):
    name: Literal["torch.optim.AdamW", "AdamW"] = "torch.optim.AdamW"
    """Optimizer class; both spellings mean torch.optim.AdamW, the only one supported."""
    kwargs: AdamWKwargs = AdamWKwargs()
    """AdamW hyper-parameters; on resume the checkpoint's optimizer state restores them (a change has no effect)."""


class SchedulerConfig(Strict):
    name: Literal["constant", "cosine"] = "constant"
    """LR after warm-up: constant, or cosine decay to `min_lr_ratio * lr` over `decay_steps`."""
    warmup_steps: NonNegInt = 0
    """Scheduler steps of linear warm-up from warmup_start_factor x lr up to lr (0: none); cosine decay follows."""
    warmup_start_factor: UnitFloat = 0.1
    """LR multiplier at the first warm-up step (only used when warmup_steps > 0)."""
    decay_steps: PositiveInt | None = None
    """Cosine horizon in scheduler steps (one per train() call, after warm-up); None means the run's train() calls:
    grpo.max_num_steps, or for PPO (max_num_steps - policy_training_start_step) x ppo_epochs for the policy and
    max_num_steps x ppo_epochs for the critic."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Cosine only: the LR floor as a fraction of lr, reached after decay_steps and held from then on."""


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


class ReferenceConfig(Strict):
    """Where the frozen reference model (the KL term's pi_ref) lives between its passes."""

    offload: bool = False
    """Park the reference on the CPU and move it to the device for each reference pass (saves device memory, costs
    two copies a step). false: it stays resident on the device, and a reference that does not fit there beside the
    policy stops set-up in one line naming this key. Either way, under bfloat16 / float16 its projections are stored
    in that precision (the values autocast would compute with; half the memory). No effect on a CPU."""


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


def _check_precision(section: str, precision: str, strategy: str) -> None:
    """float16's loss scaler decides overflow per rank; fsdp2 ranks hold different gradient shards and could
    disagree, so that pairing is refused."""
    if precision == "float16" and strategy == "fsdp2":
        raise ValueError(
            f"{section}.precision=float16 does not support {section}.data_parallel.strategy=fsdp2 (loss scaling over "
            "sharded gradients); use precision=bfloat16 or strategy=manual / ddp"
        )


class PolicyConfig(BatchingModes):
    model_name: str = BUILTIN_TINY_MODEL
    """A local Hugging Face causal-LM directory (or `builtin:tiny-arith`, the shipped model)."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Where the tokenizer and chat template come from (shared by the policy, generation and the critic)."""
    random_init: bool = False
    """Build the architecture from `model_name`'s config.json with freshly initialised weights."""
    hf_config_overrides: dict[str, Any] = {}
    """Attributes set on the model's Hugging Face config before the weights are built (e.g. {"rope_theta": ...});
    a name the config does not have is an error. Empty: the config as saved."""
    train_global_batch_size: PositiveInt = 128
    """Rows per optimizer step, summed over data-parallel ranks; a step's rows (prompts x generations) must be a
    multiple of it, and it must split into whole micro-batches on every rank."""
    train_micro_batch_size: PositiveInt = 128
    """Rows per forward/backward micro-batch (gradients accumulate up to the global batch) when neither sequence
    packing nor dynamic batching is on; with them it only sizes their default token budgets."""
    logprob_batch_size: PositiveInt | None = None
    """Rows per logprob / reference / top-k micro-batch; None means train_micro_batch_size."""
    logprob_chunk_size: PositiveInt | None = None
    """Positions per log-softmax chunk; None picks a chunk that keeps [rows, chunk, V] fp32 under ~64 MB on the
    CPU, and on a GPU under a sixteenth of the memory free at the first pass (a power of two, 64 MiB to 1 GiB)."""
    max_total_sequence_length: PositiveInt = 64
    """Token limit of prompt plus everything generated (all turns): generation stops there, and the prompt limit
    defaults to it minus generation.max_new_tokens. Also sizes the default packing / dynamic-batching budgets."""
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the forward passes (autocast; master weights and optimizer state stay float32). Generation
    decodes from a copy of the projection weights in it, refreshed after every update, with a KV cache in it; weights
    refit into generation workers are cast to it. float16 trains with dynamic loss scaling (not with fsdp2)."""
    max_grad_norm: PositiveFloat | None = 1.0
    """Clip the global L2 gradient norm (over all ranks) to this before each optimizer step; None: no clipping (the
    norm is still logged, and a non-finite one skips the step)."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward pass instead of storing them (less memory, more
    compute); ignored for models that do not support gradient checkpointing."""
    empty_cache_between_phases: bool = False
    """On a GPU, return torch's cached allocator blocks to the driver at each phase change (generation, log-prob
    passes, training): frees memory for other processes, at the cost of re-allocating it every step. Off: memory is
    released only under pressure (torch frees its cache and retries before reporting out-of-memory). No-op on CPU."""
    native_cpu_ops: bool = True
    """On CPU, the policy and reference passes of a float32 llama-family model run RMSNorm and RoPE (forward and
    backward) as relayrl's compiled kernels, the library `generation.native_cpu_decode` builds; else PyTorch ops."""
    make_sequence_length_divisible_by: PositiveInt = 1
    """Pad the width of every flattened rollout batch up to a multiple of this (1: pad to the longest row only)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer (AdamW) and its hyper-parameters."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """The learning-rate schedule, stepped once per train() call. A GRPO run that sets none gets cosine decay to
    10% (see GRPO_LR_SCHEDULE); restored from the checkpoint on resume."""
    generation: GenerationConfig = GenerationConfig()
    """How rollouts are sampled from the policy (engine, sampling, stop conditions, placement)."""
    data_parallel: DataParallelConfig = DataParallelConfig()
    """How data-parallel ranks combine gradients."""
    lora: LoraConfig = LoraConfig()
    """Train low-rank adapters instead of the full weights (off by default)."""
    reference: ReferenceConfig = ReferenceConfig()
    """The frozen reference model's placement (resident on the device by default)."""

    @model_validator(mode="after")
    def _one_batching_mode(self) -> PolicyConfig:
        _check_batching("policy", self.sequence_packing, self.dynamic_batching, self.max_total_sequence_length)
        _check_precision("policy", self.precision, self.data_parallel.strategy)
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
    """The policy loss: a clipped importance-ratio surrogate (PPO / GRPO and its DAPO, GSPO, CISPO, REINFORCE
    variants), optional truncated importance sampling, a reference-KL penalty and a positive-example NLL term."""

    reference_policy_kl_penalty: NonNegFloat = 0.02
    """KL coefficient beta of the penalty toward the initial (reference) policy; 0 builds no reference model and
    skips its log-prob pass. With use_kl_in_reward the KL goes into the reward instead of the loss."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator from sampled-token log-probs (Schulman's k1 / k2 / k3); also used by the
    generation-versus-training KL diagnostics."""
    kl_input_clamp_value: PositiveFloat | None = 20.0
    """Clamp the log-ratio log(pi_ref / pi) to +-this before the KL estimator (keeps k3's exp finite); None: off."""
    kl_output_clamp_value: PositiveFloat | None = 10.0
    """Clamp each weighted per-token KL value to +-this (clamped positions get no gradient); None: off."""
    ratio_clip_min: NonNegFloat = 0.2
    """epsilon_low: the importance ratio is clipped from below at 1 - ratio_clip_min."""
    ratio_clip_max: NonNegFloat = 0.2
    """epsilon_high: the ratio is clipped from above at 1 + ratio_clip_max (above ratio_clip_min: DAPO's
    clip-higher)."""
    ratio_clip_c: Annotated[float, Field(gt=1)] | None = None
    """Dual clip: for negative advantages the per-token loss is capped at -advantage x c (c > 1); None: off.
    Not allowed with use_cispo."""
    use_on_policy_kl_approximation: bool = False
    """Weight the per-token KL by pi_current / pi_generation (an estimate of the KL under the current policy when
    the samples came from another one); false: weight 1."""
    use_importance_sampling_correction: bool = False
    """Multiply the actor loss by pi_prev / pi_generation per token (per sequence with
    sequence_level_importance_ratios), correcting for a generation engine that differs from the trainer."""
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """How the importance weights are truncated: `tis` clamps them into [ratio_min, ratio]; `icepop` zeroes tokens
    outside it; `seq-mask-tis` drops whole sequences whose geometric-mean ratio is outside it. Requires
    use_importance_sampling_correction; None: no truncation."""
    truncated_importance_sampling_ratio: PositiveFloat | None = None
    """Upper bound of the truncation; required when truncated_importance_sampling_type is set, else must be None."""
    truncated_importance_sampling_ratio_min: NonNegFloat | None = None
    """Lower bound of the truncation (<= the upper one); required for icepop and seq-mask-tis; None means 0 for
    tis."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence, exp of the mean token log-ratio, clipped like a token ratio. Requires
    token_level_loss=false; not allowed with use_cispo or seq-mask-tis."""
    token_level_loss: bool = True
    """True: average the loss over every valid token of the global batch. False: average each sequence over its
    tokens, then over valid sequences."""
    force_on_policy_ratio: bool = False
    """Treat the ratio as exactly 1 (exp(logp - logp.detach())): no clipping, and the old-policy log-prob pass is
    skipped unless seq_logprob_error_threshold needs it. Turned on by grpo.skip_prev_logprobs_when_on_policy."""
    use_kl_in_reward: bool = False
    """Subtract beta x per-token KL from the reward instead of adding it to the loss (the loss's KL term is then 0).
    Read by the reinforce_plus_plus, gae and raw_reward estimators; with the grpo estimator no KL is applied."""
    use_cispo: bool = False
    """CISPO: -advantage x detached clipped ratio x log-prob, so clipped tokens still get a gradient. Needs
    token_level_loss and excludes disable_ppo_ratio, force_on_policy_ratio, sequence-level ratios and ratio_clip_c."""
    disable_ppo_ratio: bool = False
    """REINFORCE surrogate -advantage x log-prob: no importance ratio and no clipping."""
    positive_example_nll_weight: NonNegFloat = 0.0
    """VAPO: weight of an NLL term over the tokens of rows with reward > 0 (averaged over this micro-batch's such
    tokens). Only the legacy PPO trainer (data_plane.enabled=false) hands the loss rewards; elsewhere no effect."""


class ValueConfig(BatchingModes):
    """The critic: the policy keys that make sense for a value model (no generation, no reference)."""

    model_name: str = BUILTIN_TINY_MODEL
    """A local HF causal-LM directory, a sequence-classification (reward model) directory, or a saved critic."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Must stay unset (refused otherwise): the critic scores the policy's token ids with policy.tokenizer."""
    random_init: bool = False
    """Fresh backbone weights from `model_name`'s config.json (the head is always fresh unless the source has one)."""
    hf_config_overrides: dict[str, Any] = {}
    """Attributes set on the backbone's Hugging Face config before it is built; unknown names are errors."""
    train_global_batch_size: PositiveInt = 128
    """Rows per critic optimizer step; a step's rows must be a multiple of it (checked in PPO runs)."""
    train_micro_batch_size: PositiveInt = 128
    """Rows per critic forward/backward micro-batch without packing / dynamic batching (else sizes their budgets)."""
    logprob_batch_size: PositiveInt | None = None
    """Rows per get_values micro-batch; None means train_micro_batch_size."""
    max_total_sequence_length: PositiveInt = 64
    """Longest sequence the critic is sized for: the default packing / dynamic-batching budgets and their fit
    check use it (sequence lengths themselves follow policy.max_total_sequence_length)."""
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the critic's forward passes (autocast; master weights stay float32; float16 with dynamic loss
    scaling, not with fsdp2)."""
    max_grad_norm: PositiveFloat | None = 1.0
    """Clip the critic's global gradient L2 norm to this before each step; None: no clipping."""
    activation_checkpointing: bool = False
    """Recompute backbone activations in the backward pass (less memory, more compute)."""
    empty_cache_between_phases: bool = False
    """On a GPU, return torch's cached allocator blocks to the driver at each phase change (generation, log-prob
    passes, training): frees memory for other processes, at the cost of re-allocating it every step. Off: memory is
    released only under pressure (torch frees its cache and retries before reporting out-of-memory). No-op on CPU."""
    optimizer: OptimizerConfig = OptimizerConfig(kwargs=AdamWKwargs(lr=1e-4))
    """The critic's AdamW (default lr 1e-4, above the policy's)."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """The critic's LR schedule, one scheduler step per train() call (constant by default)."""
    head_init_std: PositiveFloat | None = None
    """Std of a fresh head's weights; None means the backbone config's initializer_range (as transformers does)."""
    data_parallel: DataParallelConfig = DataParallelConfig()
    """How the critic's data-parallel ranks combine gradients."""

    @model_validator(mode="after")
    def _one_batching_mode(self) -> ValueConfig:
        _check_batching("value", self.sequence_packing, self.dynamic_batching, self.max_total_sequence_length)
        _check_precision("value", self.precision, self.data_parallel.strategy)
        return self


class MseValueLossConfig(Strict):
    """The critic loss: half the squared error between predicted values and returns over valid tokens."""

    scale: PositiveFloat = 1.0
    """Multiplier of the value loss (the critic has its own optimizer, so it acts like a learning-rate factor)."""
    value_clip: PositiveFloat | None = None
    """Clip new values to old ± value_clip (PPO's clipped value loss); None disables it."""

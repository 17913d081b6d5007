"""The run configuration: pydantic models whose defaults *are* the embedded default run.

Key names follow the reference system (`policy.model_name`, `grpo.num_prompts_per_step`, `loss_fn.*`,
`checkpointing.save_period`, `data_plane.*`) so its users feel at home. Unknown keys and bad values are rejected
with the dotted key named. This module imports neither torch nor ray, so validation and `--help` stay fast.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
UnitFloat = Annotated[float, Field(gt=0, le=1)]

#: `checkpointing.checkpoint_must_save_by`: days:hours:minutes:seconds, each a non-negative integer.
_DURATION = re.compile(r"[0-9]+:[0-9]+:[0-9]+:[0-9]+")
#: What validation reports; `*.stop_at_validation_metric` must name one of them.
VALIDATION_METRICS = ("accuracy", "avg_length", "num_samples", "pass_k")

#: Shipped with the package (see scripts/make_tiny_model.py); resolved by relayrl.utils.paths.resolve_model_path.
BUILTIN_TINY_MODEL = "builtin:tiny-arith"


class Strict(BaseModel):
    """Base for every config block: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class PolicyConfig(Strict):
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
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    """Bin whole sequences into packed micro-batches (exclusive with dynamic_batching)."""
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    """Token-budget micro-batches of similar lengths (exclusive with sequence_packing)."""

    @model_validator(mode="after")
    def _one_batching_mode(self) -> PolicyConfig:
        _check_batching("policy", self.sequence_packing, self.dynamic_batching, self.max_total_sequence_length)
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


# ---------------------------------------------------------------------------------------------------- grpo
class RewardScalingConfig(Strict):
    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


class RewardShapingConfig(Strict):
    enabled: bool = False
    overlong_buffer_length: PositiveInt | None = None
    overlong_buffer_penalty: NonNegFloat | None = None
    max_response_length: PositiveInt | None = None
    stop_properly_penalty_coef: Annotated[float, Field(ge=0, le=1)] | None = None


class AdvEstimatorConfig(Strict):
    name: Literal["grpo", "reinforce_plus_plus"] = "grpo"
    normalize_rewards: bool | None = None
    """None means grpo.normalize_rewards."""
    use_leave_one_out_baseline: bool | None = None
    """None means grpo.use_leave_one_out_baseline."""
    minus_baseline: bool = True


class RolloutConfig(Strict):
    """What GRPO and PPO share: how a step's rollouts are drawn, validated, scored and filtered.

    The `grpo` and `ppo` blocks both extend it (their YAML keys are unchanged), so the rollout, validation, data and
    step-tail code reads one type, `MasterConfig.rollout`, and the derived quantities are defined once, here.
    """

    num_prompts_per_step: PositiveInt = 16
    num_generations_per_prompt: PositiveInt = 8
    max_rollout_turns: PositiveInt = 1
    max_num_epochs: PositiveInt = 1000
    max_num_steps: PositiveInt = 1000
    val_period: NonNegInt = 50
    val_start_at: int = -1
    val_at_start: bool = True
    val_at_end: bool = True
    val_greedy: bool = True
    """Validate with greedy decoding (deterministic accuracy); False samples like training."""
    max_val_samples: PositiveInt = 200
    val_batch_size: PositiveInt = 200
    val_num_generations_per_prompt: PositiveInt = 1
    stop_at_validation_metric: str | None = None
    stop_at_validation_threshold: float | None = None
    seed: int = 42
    overlong_filtering: bool = False
    reward_scaling: RewardScalingConfig = RewardScalingConfig()
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    seq_logprob_error_threshold: PositiveFloat | None = None
    skip_reference_policy_logprobs_calculation: bool = False
    non_finite: Literal["stop", "skip"] = "stop"
    """A NaN or infinite reward or advantage: `stop` ends the run before that step changes any weight, naming the
    step and samples; `skip` drops the offending samples' groups from the step and counts them
    (`train/non_finite_samples_skipped`)."""

    @property
    def rows_per_step(self) -> int:
        """Samples trained on per step: every prompt of the step times its generations."""
        return self.num_prompts_per_step * self.num_generations_per_prompt

    @property
    def prompts_per_batch(self) -> int:
        """Prompts the train loader yields per generation batch."""
        return self.num_prompts_per_step


class GRPOConfig(RolloutConfig):
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    advantage_clip_low: float | None = None
    advantage_clip_high: float | None = None
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: NonNegInt = 10
    batch_multiplier: PositiveInt = 1
    adv_estimator: AdvEstimatorConfig = AdvEstimatorConfig()
    skip_prev_logprobs_when_on_policy: bool = True
    """When a step is exactly one optimizer step on fresh rollouts, the old-policy logprobs equal the training
    forward's detached logprobs: skip the separate pass and use ratio = exp(logp - logp.detach()) (what TRL does).
    Off when seq_logprob_error_threshold is set, or with CISPO / REINFORCE losses, which need them."""
    invalid_tool_call_advantage: float | None = None
    """Message-level advantage penalty (legacy trainer): assistant messages flagged `is_invalid_tool_call` get this
    advantage. The reference's key; the same setting as reward_penalties.invalid_tool_call_advantage (set one)."""
    malformed_thinking_advantage: float | None = None
    """As invalid_tool_call_advantage, for messages flagged `has_malformed_thinking`."""

    @property
    def prompts_per_batch(self) -> int:
        """Dynamic sampling draws `batch_multiplier` times the prompts, since zero-std groups are dropped."""
        return self.num_prompts_per_step * (self.batch_multiplier if self.use_dynamic_sampling else 1)


class RewardPenaltiesConfig(Strict):
    """Message-level advantage penalties: an assistant message flagged by the environment gets this advantage."""

    invalid_tool_call_advantage: float | None = None
    """Advantage for messages flagged `is_invalid_tool_call`."""
    malformed_thinking_advantage: float | None = None
    """Advantage for messages flagged `has_malformed_thinking`."""
    flag_advantages: dict[str, float] = {}
    """Any other flag name -> advantage."""

    def enabled_keys(self) -> list[str]:
        keys = [
            k for k in ("invalid_tool_call_advantage", "malformed_thinking_advantage") if getattr(self, k) is not None
        ]
        keys += [f"flag_advantages.{k}" for k in self.flag_advantages]
        return keys

    def flag_to_advantage(self) -> dict[str, float]:
        out = dict(self.flag_advantages)
        if self.invalid_tool_call_advantage is not None:
            out["is_invalid_tool_call"] = self.invalid_tool_call_advantage
        if self.malformed_thinking_advantage is not None:
            out["has_malformed_thinking"] = self.malformed_thinking_advantage
        return out


# ---------------------------------------------------------------------------------------------------- data / env
class ArithmeticConfig(Strict):
    """The built-in task: `a+b` / `a-b` with operands in [min_operand, max_operand]."""

    min_operand: NonNegInt = 10
    max_operand: NonNegInt = 99
    operations: list[Literal["+", "-"]] = ["+", "-"]
    num_val_problems: PositiveInt = 200
    """Held out by a fixed seed; the shipped model never saw them in its warm start."""


class DatasetConfig(Strict):
    source: Literal["arithmetic", "file"] = "arithmetic"
    path: str | None = None
    """JSONL or Parquet file (format from the extension) when source == 'file'."""
    prompt_field: str = "prompt"
    """Field holding the user prompt text (ignored when `messages_field` is present in a row)."""
    messages_field: str = "messages"
    answer_field: str = "answer"
    task_field: str | None = "task"
    default_task: str = "math"
    split_validation_size: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Fraction carved off as validation when no validation dataset is given."""


class DataConfig(Strict):
    train: DatasetConfig = DatasetConfig()
    validation: DatasetConfig | None = None
    """None: the arithmetic task's held-out set, or a split of `train` (split_validation_size)."""
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    system_prompt: str | None = None
    prompt_template: str | None = None
    """Python format string with `{problem}`; None uses the problem text as is."""
    max_input_seq_length: PositiveInt | None = None
    """Prompt token limit; None means policy.max_total_sequence_length - generation.max_new_tokens."""
    skip_overlong_prompts: bool = False
    """Skip (and count) prompts over the limit instead of failing."""
    shuffle: bool = True
    num_workers: NonNegInt = 0


class MathEnvConfig(Strict):
    math_verify_impl: Literal["hf_math_verify"] = "hf_math_verify"
    timeout_s: PositiveFloat = 5.0
    """Per answer: a verification running longer is killed and scores 0 (counted as num_verify_timeouts)."""
    batch_timeout_s: PositiveFloat = 60.0
    """Per batch of answers sent to math-verify: once this much verification time is spent, the answers not yet
    verified score 0, a warning line gives their count and num_verify_over_budget counts them."""


class RewardModelEnvConfig(Strict):
    """`env.reward_model`: where the classifier lives and how its scores become rewards."""

    model_dir: str
    """A local HF sequence-classification directory (num_labels=1) holding its tokenizer."""
    normalize: bool = False
    """Standardise each step's scores over the batch (mean 0, std 1) before returning them as rewards."""
    device: str = "cpu"
    micro_batch_size: PositiveInt = 32
    render: Literal["chat_template", "concatenation"] = "chat_template"
    """How a conversation becomes text: the chat template over role/content, or the contents joined as they are."""


class EnvConfig(Strict):
    math: MathEnvConfig = MathEnvConfig()
    reward_model: RewardModelEnvConfig | None = None
    """Set to enable the `reward_model` task (a learned reward instead of a verifier)."""


# ---------------------------------------------------------------------------------------------------- infrastructure
class WandbConfig(Strict):
    project: str = "relayrl"
    name: str | None = None


class MlflowConfig(Strict):
    experiment_name: str = "relayrl"
    run_name: str | None = None
    tracking_uri: str | None = None


class LoggerConfig(Strict):
    tensorboard_enabled: bool = True
    wandb_enabled: bool = False
    mlflow_enabled: bool = False
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    progress_bar: bool = True
    num_train_samples_to_log: NonNegInt = 8
    """Rows of prompts/completions/rewards written to samples.jsonl per step."""
    num_val_samples_to_print: NonNegInt = 0


class CheckpointingConfig(Strict):
    enabled: bool = True
    checkpoint_dir: str | None = None
    """None means `<run_dir>/checkpoints`."""
    metric_name: str | None = "val:accuracy"
    higher_is_better: bool = True
    keep_top_k: PositiveInt | None = 2
    save_period: PositiveInt = 100
    checkpoint_must_save_by: str | None = None
    """Wall-clock budget DD:HH:MM:SS: save and stop before it runs out."""
    save_optimizer: bool = True

    @model_validator(mode="after")
    def _metric_prefix(self) -> CheckpointingConfig:
        if self.metric_name is not None and not self.metric_name.startswith(("val:", "train:")):
            raise ValueError("checkpointing.metric_name must start with 'val:' or 'train:'")
        budget = self.checkpoint_must_save_by
        if budget is not None and not _DURATION.fullmatch(budget):
            raise ValueError(
                f"checkpointing.checkpoint_must_save_by must be DD:HH:MM:SS (e.g. 00:04:00:00 for four hours), "
                f"got {budget!r}"
            )
        return self


class ClusterConfig(Strict):
    executor: Literal["local", "ray"] = "local"
    num_nodes: PositiveInt = 1
    workers_per_node: PositiveInt = 1
    cpus_per_worker: PositiveInt = 1
    gpus_per_worker: NonNegFloat = 0.0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_num_threads: PositiveInt | None = 1
    """Intra-op threads per worker. 1 by default: small models gain little from more, and on a busy machine
    spinning OpenMP threads make a step several times slower. None leaves torch's default (all cores)."""
    ray_address: str | None = None
    deterministic: bool = False
    """torch.use_deterministic_algorithms: exact resume and parity on CPU."""
    retain_freed_memory: bool = True
    """Keep freed tensor buffers (up to 32 MiB each) mapped for reuse instead of returning them to the OS (glibc
    mallopt; like running under jemalloc/tcmalloc): saves thousands of page faults per CPU training step."""
    start_timeout_s: PositiveFloat = 600.0
    """Ray executor: deadline for a worker group or the rollout actor to start (resources placed, processes up,
    models loaded); past it the run stops with one line naming what did not start."""
    call_timeout_s: PositiveFloat = 1800.0
    """Ray executor: deadline for one call on the workers or the rollout actor (a generation batch, a training
    step, a refit); a rank that is alive but stuck fails the run with one line naming the call, never hangs it.
    A dead rank is reported within seconds regardless."""


class DataPlaneConfig(Strict):
    enabled: bool = True
    """Rollout tensors live in a sample-keyed store (grpo_train_sync); false runs the legacy in-memory trainer.
    Both log identical metrics (`relayrl parity`)."""
    backend: Literal["memory", "ray", "transfer_queue"] = "memory"
    """`memory` on the local executor; in a MasterConfig with cluster.executor=ray an unset backend means `ray`."""
    storage_capacity: PositiveInt = 1_000_000
    """Maximum samples held across partitions; exceeding it is an error, never silent growth."""
    call_timeout_s: PositiveFloat = 120.0
    """Deadline for every call to a remote store (ray, transfer_queue): a dead store fails, never hangs."""
    init_timeout_s: PositiveFloat = 300.0
    """Deadline for starting or attaching to a remote store."""
    num_storage_units: PositiveInt = 2
    """transfer_queue only: storage unit actors started at bootstrap."""


# ---------------------------------------------------------------------------------------------------- ppo
class ValueConfig(Strict):
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
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    """Bin whole sequences into packed micro-batches (exclusive with dynamic_batching)."""
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    """Token-budget micro-batches of similar lengths (exclusive with sequence_packing)."""

    @model_validator(mode="after")
    def _one_batching_mode(self) -> ValueConfig:
        _check_batching("value", self.sequence_packing, self.dynamic_batching, self.max_total_sequence_length)
        return self


class MseValueLossConfig(Strict):
    scale: PositiveFloat = 1.0
    value_clip: PositiveFloat | None = None
    """Clip new values to old ± value_clip (PPO's clipped value loss); None disables it."""


class PPOAdvEstimatorConfig(Strict):
    name: Literal["gae", "raw_reward"] = "gae"
    gae_lambda: Annotated[float, Field(ge=0, le=1)] = 0.95
    gae_gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    normalize_advantages: bool = True
    gae_lambda_value: Annotated[float, Field(ge=0, le=1)] | None = None
    """Decoupled lambda for the critic's returns (VAPO); None means gae_lambda."""
    gae_lambda_policy: Annotated[float, Field(ge=0, le=1)] | None = None
    """Decoupled lambda for the actor's advantages; None means gae_lambda."""
    length_adaptive_alpha: NonNegFloat | None = None
    """Per-row policy lambda 1 - 1/(alpha * length) (VAPO); None disables it."""


class PPOConfig(RolloutConfig):
    max_num_steps: PositiveInt = 200
    ppo_epochs: PositiveInt = 1
    """Policy and value updates per rollout batch (all reuse the same advantages and old logprobs)."""
    policy_training_start_step: NonNegInt = 0
    """Critic warm-up: train only the value model until this many steps have run."""
    adv_estimator: PPOAdvEstimatorConfig = PPOAdvEstimatorConfig()


# ---------------------------------------------------------------------------------------------------- top level
#: `policy.scheduler` of a GRPO run that sets none (see MasterConfig._grpo_lr_schedule).
GRPO_LR_SCHEDULE: dict[str, Any] = {"name": "cosine", "min_lr_ratio": 0.1}


class MasterConfig(Strict):
    algorithm: Literal["grpo", "ppo"] = "grpo"
    """Which trainer `relayrl train` runs: GRPO (the `grpo` block) or actor-critic PPO (`ppo`, `value`)."""
    policy: PolicyConfig = PolicyConfig()
    loss_fn: ClippedPGLossConfig = ClippedPGLossConfig()
    grpo: GRPOConfig = GRPOConfig()
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    cluster: ClusterConfig = ClusterConfig()
    reward_penalties: RewardPenaltiesConfig = RewardPenaltiesConfig()
    data_plane: DataPlaneConfig = DataPlaneConfig()
    ppo: PPOConfig = PPOConfig()
    value: ValueConfig = ValueConfig()
    value_loss_fn: MseValueLossConfig = MseValueLossConfig()

    @model_validator(mode="before")
    @classmethod
    def _grpo_lr_schedule(cls, data: Any) -> Any:
        """In a GRPO run `policy.scheduler` defaults to cosine decay to 10% over grpo.max_num_steps (keys given win).

        Why: at a constant LR the default run's validation accuracy keeps swinging by +-3 points once it has learned
        (the last value read anywhere in 0.55-0.615 on one seed); with the decay it settles (0.61-0.625 over the
        last 350 steps). PPO and a standalone PolicyConfig (no run length to decay over) keep the constant default.
        """
        if not isinstance(data, dict) or data.get("algorithm", "grpo") != "grpo":
            return data
        policy = data.get("policy")
        if isinstance(policy, PolicyConfig):
            kept: dict[str, Any] = {}
            if "scheduler" in policy.model_fields_set:
                kept = policy.scheduler.model_dump(include=policy.scheduler.model_fields_set)
            merged = SchedulerConfig(**{**GRPO_LR_SCHEDULE, **kept})
            return {**data, "policy": policy.model_copy(update={"scheduler": merged})}
        if policy is None or isinstance(policy, dict):
            given = (policy or {}).get("scheduler")
            if given is None or isinstance(given, dict):
                raw_scheduler = {**GRPO_LR_SCHEDULE, **(given or {})}
                return {**data, "policy": {**(policy or {}), "scheduler": raw_scheduler}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _executor_defaults(cls, data: Any) -> Any:
        """data_plane.backend, when not given, is `memory` on the local executor and `ray` on the Ray executor."""
        if not isinstance(data, dict):
            return data
        cluster, plane = data.get("cluster"), data.get("data_plane")
        executor = cluster.get("executor") if isinstance(cluster, dict) else getattr(cluster, "executor", None)
        if executor == "ray" and (plane is None or (isinstance(plane, dict) and "backend" not in plane)):
            return {**data, "data_plane": {**(plane or {}), "backend": "ray"}}
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> MasterConfig:
        p = self.policy
        r = self.rollout
        block = self.algorithm
        rows = r.rows_per_step
        batch_owners = [("policy", p.train_global_batch_size, p.train_micro_batch_size)]
        if self.algorithm == "ppo":
            batch_owners.append(("value", self.value.train_global_batch_size, self.value.train_micro_batch_size))
        for owner, gbs, mbs in batch_owners:
            if rows % gbs:
                raise ValueError(
                    f"{block}.num_prompts_per_step x {block}.num_generations_per_prompt = {rows} is not divisible by "
                    f"{owner}.train_global_batch_size = {gbs}"
                )
            if gbs % mbs:
                raise ValueError(
                    f"{owner}.train_global_batch_size = {gbs} is not divisible by {owner}.train_micro_batch_size = {mbs}"
                )
            ranks = self.cluster.num_nodes * self.cluster.workers_per_node
            if gbs % (ranks * mbs):
                raise ValueError(
                    f"{owner}.train_global_batch_size = {gbs} must split into {ranks} data-parallel workers of whole "
                    f"micro-batches of {owner}.train_micro_batch_size = {mbs}: make it a multiple of {ranks * mbs}"
                )
        g = self.grpo
        if self.algorithm == "grpo" and g.num_generations_per_prompt < 2:
            raise ValueError(
                "grpo.num_generations_per_prompt must be >= 2: GRPO's advantage is a reward relative to the other "
                "generations of the same prompt, so with one generation every advantage is 0 (use algorithm: ppo)"
            )
        lo, hi = g.advantage_clip_low, g.advantage_clip_high
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"grpo.advantage_clip_low ({lo}) must be <= grpo.advantage_clip_high ({hi})")
        if g.batch_multiplier != 1 and not g.use_dynamic_sampling:
            raise ValueError("grpo.batch_multiplier must be 1 unless grpo.use_dynamic_sampling is true")
        for key in ("invalid_tool_call_advantage", "malformed_thinking_advantage"):
            if getattr(g, key) is not None and getattr(self.reward_penalties, key) is not None:
                raise ValueError(f"grpo.{key} and reward_penalties.{key} are the same setting: set one of them")
        if r.stop_at_validation_metric is not None and r.stop_at_validation_threshold is None:
            raise ValueError(f"{block}.stop_at_validation_metric requires {block}.stop_at_validation_threshold")
        if r.stop_at_validation_metric is not None and r.stop_at_validation_metric not in VALIDATION_METRICS:
            raise ValueError(
                f"{block}.stop_at_validation_metric {r.stop_at_validation_metric!r} is not a validation metric; "
                f"use one of {', '.join(VALIDATION_METRICS)}"
            )
        if r.stop_at_validation_metric == "pass_k" and r.val_num_generations_per_prompt <= 1:
            raise ValueError(f"{block}.stop_at_validation_metric 'pass_k' requires val_num_generations_per_prompt > 1")
        if r.max_val_samples % r.val_batch_size and r.max_val_samples > r.val_batch_size:
            raise ValueError(f"{block}.max_val_samples must be a multiple of {block}.val_batch_size")
        if r.skip_reference_policy_logprobs_calculation and self.loss_fn.reference_policy_kl_penalty != 0:
            raise ValueError(
                f"{block}.skip_reference_policy_logprobs_calculation requires loss_fn.reference_policy_kl_penalty == 0"
            )
        ranks = self.cluster.num_nodes * self.cluster.workers_per_node
        dp_owners = [("policy", p.data_parallel)] + ([("value", self.value.data_parallel)] if block == "ppo" else [])
        for owner, dp in dp_owners:
            if dp.strategy != "manual" and ranks > 1 and self.cluster.executor == "local":
                raise ValueError(
                    f"{owner}.data_parallel.strategy={dp.strategy!r} needs cluster.executor='ray' with {ranks} workers "
                    "(in-process workers support only 'manual')"
                )
        if self.cluster.executor == "ray":
            res = p.generation.colocated.resources
            if not p.generation.colocated.enabled and (res.num_nodes is None or res.workers_per_node is None):
                raise ValueError(
                    "policy.generation.colocated.enabled=false on cluster.executor=ray needs "
                    "policy.generation.colocated.resources.num_nodes and .workers_per_node (dedicated generation workers)"
                )
            if self.data_plane.enabled and self.data_plane.backend == "memory":
                raise ValueError(
                    "data_plane.backend=memory is in-process and cannot be shared by Ray workers; use ray (the default "
                    "on cluster.executor=ray) or transfer_queue"
                )
        if self.data_plane.enabled:
            val_rows = min(r.max_val_samples, r.val_batch_size) * r.val_num_generations_per_prompt
            need = max(r.rows_per_step * (g.batch_multiplier if self.algorithm == "grpo" else 1), val_rows)
            if self.data_plane.storage_capacity < need:
                raise ValueError(
                    f"data_plane.storage_capacity = {self.data_plane.storage_capacity} is below the {need} samples a "
                    f"step or validation batch writes; raise it to at least {need}"
                )
        if p.generation.max_new_tokens >= p.max_total_sequence_length:
            raise ValueError("policy.generation.max_new_tokens must be < policy.max_total_sequence_length")
        if self.data.train.source == "file" and not self.data.train.path:
            raise ValueError("data.train.path is required when data.train.source is 'file'")
        return self

    # Derived values live here (not as duplicated defaults) so every consumer agrees.
    @property
    def logprob_batch_size(self) -> int:
        return self.policy.logprob_batch_size or self.policy.train_micro_batch_size

    @property
    def max_prompt_length(self) -> int:
        if self.data.max_input_seq_length is not None:
            return self.data.max_input_seq_length
        return self.policy.max_total_sequence_length - self.policy.generation.max_new_tokens

    @property
    def rollout(self) -> RolloutConfig:
        """The block holding the rollout/validation settings of the selected algorithm."""
        return self.grpo if self.algorithm == "grpo" else self.ppo

    @property
    def reference_model_needed(self) -> bool:
        skip = self.rollout.skip_reference_policy_logprobs_calculation
        return self.loss_fn.reference_policy_kl_penalty > 0 and not skip

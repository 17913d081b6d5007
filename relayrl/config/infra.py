"""The run's surroundings: `data`, `env`, `logger`, `checkpointing`, `cluster`, `data_plane`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from relayrl.config.base import DURATION_PATTERN, NonNegFloat, NonNegInt, Strict


# ---------------------------------------------------------------------------------------------------- data / env
class ArithmeticConfig(Strict):
    """The built-in task: `a+b` / `a-b` (and `a*b`, the tool-use task's) with operands in [min_operand, max_operand]."""

    min_operand: NonNegInt = 10
    """Smallest operand (inclusive); must not exceed max_operand."""
    max_operand: NonNegInt = 99
    """Largest operand (inclusive); every pair of operands in range is a problem."""
    operations: list[Literal["+", "-", "*"]] = ["+", "-"]
    """Operations to generate problems for (non-empty, no duplicates); `*` is the tool-use task's
    (`relayrl.environments.calculator`), which the shipped tiny-arith model was never taught."""
    num_val_problems: PositiveInt = 200
    """Held out by a fixed seed; the shipped model never saw them in its warm start."""


class DatasetConfig(Strict):
    """One prompt dataset: the built-in arithmetic task, a local file, a Hugging Face dataset or Python rows."""

    source: Literal["arithmetic", "file", "hf", "python"] = "arithmetic"
    """Where the prompts come from: the built-in arithmetic task; a JSONL / Parquet `file`; a Hugging Face `hf`
    dataset (`path` is a directory written by `save_to_disk`, else a name for `datasets.load_dataset`); or
    `python`: rows handed to `relayrl.train(train_dataset=...)`."""
    path: str | None = None
    """JSONL or Parquet file (format from the extension) when source == 'file'; for source == 'hf' a
    `save_to_disk` directory or a dataset name (its cache and HF_DATASETS_OFFLINE are honoured)."""
    split: str = "train"
    """source == 'hf': the split to read (a dataset saved or published with several splits)."""
    subset: str | None = None
    """source == 'hf': the dataset's configuration name (the second argument of `datasets.load_dataset`)."""
    prompt_field: str = "prompt"
    """Field holding the user prompt text (ignored when `messages_field` is present in a row)."""
    messages_field: str = "messages"
    """Field holding a prompt conversation: a non-empty list of {role, content} strings, used as is (no
    prompt_template); wins over prompt_field when a row has it."""
    answer_field: str = "answer"
    """Field holding the reference answer: required by rows the math verifier scores, optional otherwise (reward
    functions receive it, like every other column, as a keyword argument). Here and in prompt_field a dotted name
    (`reward_model.ground_truth`, `prompt.0.content`) reads a nested column when no column has that exact name."""
    answer_after: str | None = None
    """Keep only the answer text after the last occurrence of this marker, stripped (GSM8K's answers end in
    `#### 42`); None: the answer as the row gives it."""
    task_field: str | None = "task"
    """Field naming a row's task (the environment that scores it, e.g. `math`, `reward_model`); None, or a row
    without it, means default_task."""
    default_task: str = "math"
    """Task of rows that name none (every row of the arithmetic source)."""
    split_validation_size: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """File source: fraction of the rows carved off (seeded shuffle) as validation when data.validation is None."""
    repeat: PositiveInt = 1
    """Read the rows this many times, one whole copy after another (NeMo RL's `repeat`: its AIME and MATH-500
    validation sets are 16 copies, each copy sampled once, so accuracy averages 16 samples per problem).
    max_val_samples and val_batch_size count the copies' rows. A training set split by split_validation_size is
    repeated after the split."""


class DataConfig(Strict):
    train: DatasetConfig = DatasetConfig()
    """The training prompts."""
    validation: DatasetConfig | None = None
    """None: the arithmetic task's held-out set, or a split of `train` (split_validation_size), else no validation."""
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    """The built-in arithmetic task, used by any dataset whose source is `arithmetic`."""
    system_prompt: str | None = None
    """System message put first in every prompt that does not already start with one; None: no system message."""
    prompt_template: str | None = None
    """Python format string with `{problem}`; None uses the problem text as is."""
    max_input_seq_length: PositiveInt | None = None
    """Prompt token limit; None means policy.max_total_sequence_length - generation.max_new_tokens."""
    skip_overlong_prompts: bool = False
    """Skip (and count) prompts over the limit instead of failing."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded by the rollout seed); false keeps file order."""
    num_workers: NonNegInt = 0
    """DataLoader worker processes for the train and validation loaders (0: load in the main process)."""


class MathEnvConfig(Strict):
    """`env.math`: the verifier that scores `math` tasks 1 (answer matches the ground truth) or 0."""

    math_verify_impl: Literal["hf_math_verify", "dapo_math_verify"] = "hf_math_verify"
    """Answer checker. `hf_math_verify`: the last `\\boxed{}` of the response against the ground truth, by the
    math-verify package in a child process. `dapo_math_verify`: DAPO's check, the last `Answer: ...` line in the
    response's final 300 characters string-equal to the ground truth after both are normalised (no sympy)."""
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
    """Where the classifier runs: `cpu`, `cuda` or `auto` (a GPU when one is visible)."""
    micro_batch_size: PositiveInt = 32
    """Conversations scored per classifier forward pass."""
    render: Literal["chat_template", "concatenation"] = "chat_template"
    """How a conversation becomes text: the chat template over role/content, or the contents joined as they are."""


#: The task name whose rows the configured reward functions score (`env.reward_fns`, `relayrl.train(reward_fns=)`).
REWARD_FNS_TASK = "reward_fns"
#: Task name of rows played out by the one `env.environment_factory` class (several classes: their own names).
ENVIRONMENT_TASK = "environment"


class OpenEnvConfig(Strict):
    """`env.openenv`: an OpenEnv server as the run's environment (`relayrl.environments.openenv_env`)."""

    base_url: str
    """The server's address, e.g. `http://127.0.0.1:8000` (one WebSocket session per rollout)."""
    action: str
    """The server's Action class by import path (`module:Class` or `file.py:Class`): its fields are the tool's
    arguments."""
    client: str | None = None
    """An `EnvClient` subclass by import path; None uses openenv's `GenericEnvClient` (plain dicts)."""
    tool_name: str = "step"
    """The name the model calls the server's step by."""
    observation_field: str | None = None
    """The observation field holding its text; None: its only field besides done/reward/metadata, else those as
    JSON."""
    reset_columns: list[str] = []
    """Dataset columns passed to the server's reset as keyword arguments (e.g. which task to play)."""
    timeout_s: PositiveFloat = 30.0
    """Deadline of the connection and of each reply; a server past it has failed (`env.on_server_error`)."""


class EnvConfig(Strict):
    math: MathEnvConfig = MathEnvConfig()
    """Settings of the `math` task's verifier."""
    reward_model: RewardModelEnvConfig | None = None
    """Set to enable the `reward_model` task (a learned reward instead of a verifier)."""
    reward_fns: list[str] = []
    """Reward functions by import path, `module:function` or `file.py:function`, each called as
    `f(prompts, completions, **columns) -> list[float]`. When set, they score the rows of task `reward_fns`, which
    becomes the datasets' default task unless `data.*.default_task` is given; a row's reward is their weighted sum."""
    reward_weights: list[float] | None = None
    """One weight per reward function (in order); None weighs each 1.0."""
    environment_factory: str | dict[str, str] | None = None
    """A TRL-style environment class by import path (`module:Class` or `file.py:Class`), instantiated once per
    rollout: `reset(**row) -> str | None`, its public documented methods are the model's tools, optional
    `get_reward() -> float` (added to the reward functions' sum). Its rows become task `environment`. A mapping
    `{name: path}` runs several classes in one run, each row routed by its `environment` column (data.*.task_field)."""
    tool_call_parser: str = "hermes"
    """How tool calls are read from a reply: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    the Qwen2.5 / Hermes templates' format) or `module:function` / `file.py:function` taking the reply text and
    returning a list of `{"name", "arguments"}` dicts (raising ValueError for a malformed call)."""
    tool_timeout_s: PositiveFloat = 60.0
    """Deadline of one tool call; a call past it costs this long, its result tells the model it timed out, and it
    is counted (`env/tool_timeouts`). Calls of a batch run concurrently (one thread each)."""
    openenv: OpenEnvConfig | None = None
    """Set to play every episode on an OpenEnv server (in place of an `environment_factory` class; task
    `environment`): reset and step through the `openenv` package's client, the step as the model's one tool."""
    on_server_error: Literal["fail", "count"] = "fail"
    """What a served environment's failure (lost or refused connection, no reply within its timeout) does: `fail`
    ends the run with one line; `count` ends that episode (reward 0 from the environment) and counts it
    (`env/server_errors`)."""
    reward_timeout_s: PositiveFloat | None = 600.0
    """Deadline for one reward function's call on a batch (on every executor): past it the run stops with one line
    naming the function, never hangs. None: no deadline."""

    @model_validator(mode="after")
    def _reward_fn_paths(self) -> EnvConfig:
        for entry in self.reward_fns:
            module, _, name = entry.rpartition(":")
            if not module or not name:
                raise ValueError(f"env.reward_fns entry {entry!r} must look like module:function or file.py:function")
        w = self.reward_weights
        if w is not None and self.reward_fns and len(w) != len(self.reward_fns):
            raise ValueError(
                f"env.reward_weights has {len(w)} weights for {len(self.reward_fns)} env.reward_fns; give one each"
            )
        factories = self.environment_factory
        paths = [factories] if isinstance(factories, str) else list((factories or {}).values())
        if isinstance(factories, dict) and not factories:
            raise ValueError("env.environment_factory is an empty mapping; give {name: module:Class, ...} or null")
        for entry in paths:
            module, _, name = entry.rpartition(":")
            if not module or not name:
                raise ValueError(
                    f"env.environment_factory entry {entry!r} must look like module:Class or file.py:Class"
                )
        if self.openenv is not None and self.environment_factory is not None:
            raise ValueError("env.openenv and env.environment_factory are both set; give one environment")
        if self.tool_call_parser != "hermes" and not all(self.tool_call_parser.rpartition(":")[::2]):
            raise ValueError(
                f"env.tool_call_parser {self.tool_call_parser!r} must be 'hermes' or module:function / file.py:function"
            )
        return self


# ---------------------------------------------------------------------------------------------------- infrastructure
class WandbConfig(Strict):
    project: str = "relayrl"
    """W&B project the run is logged to."""
    name: str | None = None
    """W&B run name; None lets W&B pick one."""


class MlflowConfig(Strict):
    experiment_name: str = "relayrl"
    """MLflow experiment the run is logged under."""
    run_name: str | None = None
    """MLflow run name; None lets MLflow pick one."""
    tracking_uri: str | None = None
    """MLflow tracking server or store; None: a file store at `<run_dir>/mlflow`."""


class FlightRecorderConfig(Strict):
    """`logger.flight_recorder`: every recorded step's rollout columns as one Parquet file in `RUN_DIR/rollouts/`,
    what `relayrl replay`, `relayrl diff` and `relayrl inspect` read."""

    enabled: bool = True
    """Write `rollouts/step_NNNNNN.parquet` (sample keys, token ids, masks, log-probs, rewards, advantages, text);
    written by whoever holds the rows (the rollout actor on the data plane), never changing a training metric."""
    every_n_steps: PositiveInt = 1
    """Record steps whose number is a multiple of this (1: every step; replay needs every step it replays)."""
    keep_last: PositiveInt = 100
    """Keep only the newest this many step files (older ones are deleted as new ones are written): bounds disk use."""


class LoggerConfig(Strict):
    """Where metrics go besides `<run_dir>/metrics.jsonl`, which is always written."""

    log_dir: str = "runs"
    """Where `relayrl train` without --run-dir creates the run directory (the next free <log_dir>/NNN)."""
    tensorboard_enabled: bool = True
    """Write TensorBoard event files under `<run_dir>/tensorboard`."""
    wandb_enabled: bool = False
    """Also log to Weights & Biases (needs the wandb package; checked before the model loads)."""
    mlflow_enabled: bool = False
    """Also log to MLflow (needs the mlflow package; checked before the model loads)."""
    wandb: WandbConfig = WandbConfig()
    """W&B settings, read when wandb_enabled."""
    mlflow: MlflowConfig = MlflowConfig()
    """MLflow settings, read when mlflow_enabled."""
    progress_bar: bool = True
    """A live progress bar when the console is a terminal; false (or no terminal): one line per step."""
    num_train_samples_to_log: NonNegInt = 8
    """Rows of prompts/completions/rewards written to samples.jsonl per step."""
    num_val_samples_to_print: NonNegInt = 0
    """How many validation conversations to print to the console (as one line each, with their reward) after each
    validation; all of them go to `<run_dir>/val_data_step<N>.jsonl` regardless."""
    flight_recorder: FlightRecorderConfig = FlightRecorderConfig()
    """Per-step rollout recording for replay, diff and inspect (see FlightRecorderConfig)."""


class CheckpointingConfig(Strict):
    enabled: bool = True
    """Save step_N checkpoints (every save_period steps, at the last step, on early stop, time-out or a stop
    signal); false saves none, so the run cannot be resumed."""
    checkpoint_dir: str | None = None
    """None means `<run_dir>/checkpoints`."""
    metric_name: str | None = "val:accuracy"
    """`val:<metric>` or `train:<metric>`, stored with each checkpoint to rank them for keep_top_k and the best
    checkpoint; None ranks by recency."""
    higher_is_better: bool = True
    """Ranking direction for metric_name (ties go to the more recent step)."""
    keep_top_k: PositiveInt | None = 2
    """Periodic checkpoints kept: the k best by metric_name (or the k newest); the newest checkpoint is always kept.
    None keeps every checkpoint."""
    save_period: PositiveInt = 100
    """Save after every step divisible by this; these are the periodic checkpoints keep_top_k ranks."""
    checkpoint_must_save_by: str | None = None
    """Wall-clock budget DD:HH:MM:SS: save and stop before it runs out."""
    save_optimizer: bool = True
    """Also save optimizer and LR-scheduler state (policy and PPO critic) so a resume continues exactly; false
    saves weights only and a resume starts the optimizer fresh."""
    save_data_plane: bool = False
    """Also save the data plane's store (every partition's rows, tags and claim cursors) into each checkpoint's
    `data_plane/` directory and load it on resume (`DataPlaneClient.save_checkpoint`); async GRPO's rollouts in
    flight are then kept there instead of in its own state file. False saves none."""

    @model_validator(mode="after")
    def _metric_prefix(self) -> CheckpointingConfig:
        if self.metric_name is not None and not self.metric_name.startswith(("val:", "train:")):
            raise ValueError("checkpointing.metric_name must start with 'val:' or 'train:'")
        budget = self.checkpoint_must_save_by
        if budget is not None and not DURATION_PATTERN.fullmatch(budget):
            raise ValueError(
                f"checkpointing.checkpoint_must_save_by must be DD:HH:MM:SS (e.g. 00:04:00:00 for four hours), "
                f"got {budget!r}"
            )
        return self


class ClusterConfig(Strict):
    executor: Literal["local", "ray"] = "local"
    """`local`: every worker in this process (threads and an in-process collective when there are several).
    `ray`: one Ray actor per worker in a placement group (needs the `ray` extra)."""
    num_nodes: PositiveInt = 1
    """Nodes; data-parallel ranks = num_nodes x workers_per_node (for the policy and the critic alike)."""
    workers_per_node: PositiveInt = 1
    """Workers (data-parallel ranks) per node."""
    cpus_per_worker: PositiveInt = 1
    """Ray executor: CPUs reserved per worker (placement only; also sizes a local Ray that relayrl starts)."""
    gpus_per_worker: NonNegFloat = 0.0
    """Ray executor: GPUs reserved per worker (fractions allowed); with GPUs, generation must not be colocated."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device of the workers: `auto` takes a GPU when torch sees one, else the CPU; `cuda` fails without
    one."""
    torch_num_threads: PositiveInt | None = 1
    """Intra-op threads per worker. 1 by default: small models gain little from more, and on a busy machine
    spinning OpenMP threads make a step several times slower. None leaves torch's default (all cores)."""
    ray_address: str | None = None
    """Ray executor: address of an existing Ray cluster to join. None: the RAY_ADDRESS environment variable if set
    (what `ray job submit` gives a job), else a new local Ray (never one `ray start` left running)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms: exact resume and parity on CPU."""
    retain_freed_memory: bool = True
    """Keep freed tensor buffers (up to 32 MiB each) mapped for reuse instead of returning them to the OS (glibc
    mallopt; like running under jemalloc/tcmalloc): saves thousands of page faults per CPU training step."""
    start_timeout_s: PositiveFloat = 600.0
    """Deadline for a Ray worker group or the rollout actor to start (resources placed, processes up, models
    loaded), and for the async producer's generation process to load its model; past it the run stops with one line
    naming what did not start."""
    call_timeout_s: PositiveFloat = 1800.0
    """Deadline for one call on the workers (Ray ranks, local rank threads), the rollout actor or the async
    producer's generation process (a generation batch, a training step, a refit); a worker that is alive but stuck
    fails the run with one line naming the call, never hangs it. A dead Ray rank is reported within seconds
    regardless."""
    wait_timeout_s: PositiveFloat = 1800.0
    """Deadline for a hand-off between threads of one process: the async trainer waiting for the producer's next
    batch (or a drain before a checkpoint), joining the producer, a lock held across another blocking call. Past
    it the run stops with one line naming the wait."""
    collective_timeout_s: PositiveFloat = 1800.0
    """Deadline for one collective (torch.distributed gloo/nccl groups: gradients, the weight broadcast; the local
    executor's rank barrier) and for each message of a refit over ZMQ IPC; a rank that never joins fails the run
    with one line naming the operation and the rank."""


class DataPlaneConfig(Strict):
    enabled: bool = True
    """Rollout tensors live in a sample-keyed store (grpo_train_sync); false runs the legacy in-memory trainer.
    Both log identical metrics (`relayrl parity`)."""
    backend: Literal["memory", "ray", "transfer_queue"] = "memory"
    """`memory`: an in-process store (local executor only). `ray`: the same store in a named Ray actor.
    `transfer_queue`: the transferqueue package's storage units. Unset: `memory`, or `ray` on cluster.executor=ray."""
    storage_capacity: PositiveInt = 1_000_000
    """Maximum samples held across partitions; exceeding it is an error, never silent growth."""
    call_timeout_s: PositiveFloat = 120.0
    """Deadline for every call to a remote store (ray, transfer_queue): a dead store fails, never hangs."""
    init_timeout_s: PositiveFloat = 300.0
    """Deadline for starting or attaching to a remote store."""
    num_storage_units: PositiveInt = 2
    """transfer_queue only: storage unit actors started at bootstrap."""
    verify_checksums: bool = True
    """Every put records a checksum per row and field (computed where the data is); every get verifies the rows
    and fields it fetched, so a row changed in the store or in transit fails that get naming its key and field."""

    @model_validator(mode="before")
    @classmethod
    def _nested_blocks(cls, data: Any) -> Any:
        """NeMo RL's per-backend blocks (`data_plane.simple.{storage_capacity, num_storage_units}`) as the flat keys.

        `simple` is TransferQueue's store, which relayrl replaces with its own: the block applies to whichever
        backend runs. A block named for a relayrl backend (`memory`, `ray`, `transfer_queue`) applies when that
        backend is the one selected. A block for a store relayrl lacks (`mooncake_cpu`) is refused, as is a nested
        key that contradicts its flat twin."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in [k for k in data if k in NESTED_DATA_PLANE_BLOCKS or k in FOREIGN_DATA_PLANE_BLOCKS]:
            block = data.pop(name)
            if name in FOREIGN_DATA_PLANE_BLOCKS:
                raise ValueError(
                    f"data_plane.{name}: relayrl has no {name} store (its backends: memory, ray, transfer_queue); "
                    "remove the block"
                )
            if block is None:
                continue
            if not isinstance(block, dict):
                raise ValueError(f"data_plane.{name} must be a mapping of data_plane keys, got {type(block).__name__}")
            if name != "simple" and data.get("backend") != name:
                raise ValueError(
                    f"data_plane.{name} configures the {name} backend, but data_plane.backend is "
                    f"{data.get('backend', 'unset')!r}; set data_plane.backend={name} or remove the block"
                )
            for key, value in block.items():
                if key not in NESTED_DATA_PLANE_KEYS:
                    raise ValueError(f"data_plane.{name}.{key}: not a data plane sizing key {NESTED_DATA_PLANE_KEYS}")
                if key in data and data[key] != value:
                    raise ValueError(f"data_plane.{name}.{key}={value!r} contradicts data_plane.{key}={data[key]!r}")
                data[key] = value
        return data


NESTED_DATA_PLANE_BLOCKS = ("simple", "memory", "ray", "transfer_queue")
"""`data_plane.<block>` names whose keys map onto DataPlaneConfig's flat keys (`simple`: NeMo RL's spelling)."""
FOREIGN_DATA_PLANE_BLOCKS = ("mooncake_cpu",)
"""NeMo RL data-plane stores relayrl does not have: a block for one is refused in one line."""
NESTED_DATA_PLANE_KEYS = ("storage_capacity", "num_storage_units", "call_timeout_s", "init_timeout_s")
"""The keys a nested block may set."""

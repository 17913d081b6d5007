"""Build everything a run needs from a validated config, resuming from the latest complete checkpoint if any.

One set-up for every trainer: GRPO and PPO, legacy and data-plane, differ here only in the critic (built for PPO
alone) and in which policy/critic classes carry the tensors (driver-side, or attached to the data plane): the kind
of the components (`components.py`).
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.algorithms.components import ComponentsT, DataPlaneComponents, LegacyComponents
from relayrl.algorithms.preflight import (
    check_machine,
    check_model_and_tokenizer,
    check_task_environments,
    read_chat_template,
)
from relayrl.algorithms.protocols import (
    ColocatedWeights,
    Generation,
    Tokenizer,
)
from relayrl.algorithms.resume import check_dataset, refuse_lost_checkpoints, schedule_config
from relayrl.algorithms.trainer_common import effective_loss_config
from relayrl.config import REWARD_FNS_TASK, MasterConfig
from relayrl.utils import deadlines
from relayrl.utils.checkpoint import (
    DATALOADER_STATE,
    RNG_STATE,
    CheckpointManager,
    data_plane_client_of,
    load_data_plane,
    load_save_state,
)
from relayrl.utils.checkpoint_read import remove_stale_readers
from relayrl.utils.config_io import dump_config
from relayrl.utils.dir_lock import DirectoryInUseError, lock_run_directories
from relayrl.utils.jsonl import read_jsonl
from relayrl.utils.logger import Logger
from relayrl.utils.paths import resolve_tokenizer_path
from relayrl.utils.seeding import enable_determinism, restore_rng_state, set_seed
from relayrl.utils.state_file import load_state_file


class SetupError(Exception):
    """User input that made the run impossible to build (bad path, model directory, dataset); one line."""


@dataclass
class UserInputs:
    """What `relayrl.train` hands over beside the config: dataset rows (`data.*.source: python`) and reward
    functions, which no config file can hold."""

    train_rows: list[dict[str, Any]] | None = None
    val_rows: list[dict[str, Any]] | None = None
    reward_fns: list[Callable[..., Any]] | None = None
    environment_factory: type | dict[str, type] | None = None
    """Environment class(es) of `relayrl.train(environment_factory=...)`: one, or {name: class}."""


#: Files of which a Hugging Face tokenizer directory holds at least one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(cfg: MasterConfig) -> Tokenizer:
    """Tokenizer of `policy.tokenizer.name` (default: the model's); pad falls back to eos, as users expect."""
    from transformers import AutoTokenizer

    path = resolve_tokenizer_path(cfg.policy.tokenizer.name or cfg.policy.model_name)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        key = "policy.tokenizer.name" if cfg.policy.tokenizer.name else "policy.model_name"
        raise ValueError(
            f"{key} {path} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, ...); "
            "set policy.tokenizer.name to a directory that has them"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    template = cfg.policy.tokenizer.chat_template
    if template is not None:
        tokenizer.chat_template = read_chat_template(template)
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer at {path} has no chat template; set policy.tokenizer.chat_template")
    return tokenizer


def check_trainer_executor(cfg: MasterConfig) -> None:
    """Refuse, before any worker starts, the executor set-ups that cannot work."""
    c = cfg.cluster
    if c.executor == "ray" and cfg.policy.generation.colocated.enabled and c.gpus_per_worker > 0:
        raise ValueError(
            "cluster.executor=ray with GPUs: colocated generation workers would need the policy's GPUs a second time; "
            "set policy.generation.colocated.enabled=false and policy.generation.colocated.resources.*"
        )


def start_ray_for_run(cfg: MasterConfig) -> None:
    """Start (or join) Ray sized for every worker group of the run: policy, value (PPO) and generation ranks. The
    local executor needs Ray only for a Ray-hosted data plane (`ray`, `transfer_queue`): its store actors, which
    for transfer_queue take one CPU each (controller and storage units)."""
    c, dp = cfg.cluster, cfg.data_plane
    if c.executor != "ray" and not (dp.enabled and dp.backend != "memory"):
        return
    from relayrl.distributed.ray_placement import ensure_ray

    if c.executor != "ray":
        actors = dp.num_storage_units + 1 if dp.backend == "transfer_queue" else 1
        ensure_ray(c.model_copy(update={"num_nodes": 1, "workers_per_node": actors, "cpus_per_worker": 1}))
        return
    from relayrl.models.generation.distributed import generation_cluster

    gen = generation_cluster(cfg.policy.generation, c)
    ranks = c.num_nodes * c.workers_per_node * (2 if cfg.algorithm == "ppo" else 1)
    ranks += gen.num_nodes * gen.workers_per_node
    ensure_ray(c.model_copy(update={"num_nodes": 1, "workers_per_node": ranks}))


def check_cluster_storage(cfg: MasterConfig, run_dir: Path) -> MasterConfig:
    """`cfg` with local model paths made absolute on the driver (each actor has its own working directory), after
    checking that every Ray node sees the run directory and those paths (one line naming a node that does not)."""
    from relayrl.distributed.ray_nodes import absolute_local_path, check_nodes_see

    policy = cfg.policy.model_copy(update={"model_name": absolute_local_path(cfg.policy.model_name)})
    value = cfg.value.model_copy(update={"model_name": absolute_local_path(cfg.value.model_name)})
    cfg = cfg.model_copy(update={"policy": policy, "value": value})
    named = {"policy.model_name": policy.model_name}
    if cfg.algorithm == "ppo":
        named["value.model_name"] = value.model_name
    local = {key: path for key, path in named.items() if Path(path).is_absolute()}  # Hub ids and builtins: per node
    check_nodes_see(run_dir, local, cfg.cluster.start_timeout_s)
    return cfg


def build_generation(cfg: MasterConfig, tokenizer: Tokenizer, policy: ColocatedWeights, seed: int) -> Generation:
    """The generation engine: in-process over the policy's live weights (local executor), or Ray generation
    workers kept in sync by refit (Ray executor; they call the policy's refit methods, `RefitSource`)."""
    if cfg.cluster.executor == "ray":
        from relayrl.models.generation.distributed import DistributedGeneration

        return DistributedGeneration(
            cfg.policy.generation,
            tokenizer,
            policy,
            cluster=cfg.cluster,
            policy_config=cfg.policy,
            max_total_sequence_length=cfg.policy.max_total_sequence_length,
            seed=seed,
        )
    from relayrl.models.generation.hf_generation import HfGeneration

    engine = HfGeneration(
        cfg.policy.generation,
        tokenizer,
        policy.generation_source,  # rank 0's worker: the colocated engine reads its weights in place
        device=policy.device,
        max_total_sequence_length=cfg.policy.max_total_sequence_length,
        seed=seed,
        precision=cfg.policy.precision,
    )
    engine.verify_against = policy.refit_digests  # checked at every prepare_for_generation ...
    engine.trainer_storage = policy.generation_storage  # ... where the engine does not read the trainer's tensors
    return engine


@dataclass(frozen=True)
class ResumeOptions:
    """How a resume may depart from the run it continues (the CLI's --restart and --allow-inexact-resume)."""

    restart: bool = False  # no intact checkpoint where there were some: start over instead of refusing
    allow_inexact: bool = False  # the training set's contents changed since the checkpoint: resume anyway


def setup(
    cfg: MasterConfig, run_dir: Path, inputs: UserInputs | None = None, resume: ResumeOptions = ResumeOptions()
) -> LegacyComponents | DataPlaneComponents:
    """Seed, build data, policy (and critic for PPO), generation, environments, logger and checkpointer; restore
    state on resume. `inputs`: rows and reward functions given in Python. `DataPlaneComponents` when
    `data_plane.enabled`, else `LegacyComponents`."""
    if cfg.data_plane.enabled:  # rollout tensors go through the sample-keyed store, not the driver
        return _setup(DataPlaneComponents, cfg, run_dir, inputs, resume)
    return _setup(LegacyComponents, cfg, run_dir, inputs, resume)


def _setup(
    kind: type[ComponentsT], cfg: MasterConfig, run_dir: Path, inputs: UserInputs | None, resume: ResumeOptions
) -> ComponentsT:
    """`setup` for one kind of components: its classes build the policy and critic, typed with its Protocols."""
    from relayrl.algorithms.loss_functions import ClippedPGLossFn
    from relayrl.algorithms.value_loss import MseValueLossFn
    from relayrl.environments.registry import build_environments, build_reward_fn_env, build_tool_environments
    from relayrl.experience.data import build_dataloaders
    from relayrl.experience.episodes import check_chat_template
    from relayrl.experience.ray_rollout import check_environments_ship

    inputs = inputs or UserInputs()
    check_trainer_executor(cfg)
    check_machine(cfg)
    reward_env = build_reward_fn_env(cfg.env, inputs.reward_fns)  # imported now: a bad path fails before any load
    tool_envs = build_tool_environments(cfg, inputs.environment_factory, reward_env)  # so are environment classes
    # One live run per directory (its run and checkpoint directories), checked before anything loads:
    # DirectoryInUseError names the holder's pid.
    checkpoint_dir = Path(cfg.checkpointing.checkpoint_dir or run_dir / "checkpoints")
    run_locks = lock_run_directories(run_dir, checkpoint_dir)
    # Ray actors work in another directory than the driver: every path handed on (checkpoints, recorded rollouts)
    # is absolute, or a relative run directory would get the actors' files somewhere else.
    run_dir, checkpoint_dir = run_dir.absolute(), checkpoint_dir.absolute()
    deadlines.configure(cfg.cluster)  # before any rank or child starts: they inherit the deadlines
    if cfg.cluster.torch_num_threads is not None:
        torch.set_num_threads(cfg.cluster.torch_num_threads)
    if cfg.cluster.deterministic:
        enable_determinism()
    set_seed(cfg.rollout.seed)

    tokenizer = load_tokenizer(cfg)
    check_model_and_tokenizer(cfg, tokenizer)
    for tool_env in tool_envs.values():  # a template that cannot render tool turns: refused before the model loads
        check_chat_template(
            tokenizer, getattr(tool_env, "tools", None), cfg.policy.tokenizer.chat_template_kwargs or {}
        )
    if cfg.algorithm == "ppo":
        _check_value_vocabulary(cfg, tokenizer)
    dataloader, val_dataloader = build_dataloaders(
        cfg, tokenizer, (inputs.train_rows, inputs.val_rows), frozenset(tool_envs)
    )
    task_names: list[str] = _task_names(dataloader, val_dataloader)  # annotated: mypy re-checks the body per kind
    check_task_environments([cfg.data.train.default_task, *task_names], list(tool_envs))
    if reward_env is None and REWARD_FNS_TASK in task_names:
        raise ValueError(
            f"rows of task {REWARD_FNS_TASK!r} need reward functions: env.reward_fns=[module:function, ...] "
            "(or reward_fns= in relayrl.train)"
        )
    start_ray_for_run(cfg)
    if cfg.cluster.executor == "ray":  # every node must see the run directory and the model paths: checked now
        cfg = check_cluster_storage(cfg, run_dir)
    if tool_envs and cfg.cluster.executor == "ray" and cfg.data_plane.enabled:  # rollouts run in a Ray actor
        check_environments_ship(tool_envs, cfg.cluster.start_timeout_s)  # its classes must load there: checked now
    checkpointer = CheckpointManager(cfg.checkpointing, checkpoint_dir)
    remove_stale_readers(checkpoint_dir)
    last = checkpointer.get_latest_checkpoint_path()
    if last is None:  # checkpoints there, none intact: never silently start over
        refuse_lost_checkpoints(checkpointer, resume.restart, checkpointer.log)
    save_state = load_save_state(checkpointer.load_training_info(last) if last else None)
    check_dataset(dataloader.dataset, save_state, last, resume.allow_inexact)
    model_cfg = schedule_config(cfg, save_state, checkpointer.log)  # the LR horizon the run started with
    # Loader and RNG state are read (never unpickled) now, so a refused file fails the run before any model loads.
    loader_state: Any = load_state_file(last / DATALOADER_STATE) if last else None
    rng_state: Any = load_state_file(last / RNG_STATE) if last else None

    if last is not None:
        _check_lora_checkpoint(cfg, last)
    # The reference model is always the *base* model (not the resumed weights), so a resumed run's KL equals an
    # uninterrupted run's; the checkpoint's weights and optimizer are loaded into the live policy afterwards.
    try:
        policy = kind.build_policy(model_cfg, tokenizer)
    except Exception as exc:
        if (err := weights_error("policy.model_name", cfg.policy.model_name, exc)) is exc:
            raise
        raise err from exc
    if last is not None:
        optimizer_dir = last / "policy" / "optimizer"
        policy.load_checkpoint(
            weights_path=str(last / "policy" / "weights"),
            optimizer_path=str(optimizer_dir) if optimizer_dir.is_dir() else None,
        )
        dataloader.load_state_dict(loader_state)
        if cfg.checkpointing.save_data_plane:
            load_data_plane(data_plane_client_of(policy), last)
    value = None
    try:
        value = kind.build_value(model_cfg, tokenizer, last) if cfg.algorithm == "ppo" else None
        policy_generation = build_generation(cfg, tokenizer, policy, cfg.rollout.seed)
    except BaseException:
        if value is not None:
            value.shutdown()  # the critic's client is attached to the store the policy owns: close it first
        policy.shutdown()
        raise
    task_to_env = build_environments(cfg, task_names, reward_env, tool_envs)
    loss_fn = ClippedPGLossFn(effective_loss_config(cfg))

    logger = Logger(cfg.logger, run_dir, total_steps=cfg.rollout.max_num_steps, start_step=save_state.total_steps)
    dump_config(cfg, run_dir / "config.yaml")
    logger.log_hyperparams(cfg.model_dump(mode="json"))

    if cfg.policy.lora.enabled:
        from relayrl.models.policy.lora import fast_path_note

        if (note := fast_path_note(cfg.policy)) is not None:
            logger.print_message(note)
    if last is not None:
        restore_rng_state(rng_state["global"])
        policy_generation.set_rng_state(rng_state["generation"])
        if "kv_scales" in rng_state:  # FP8 KV cache: the scales calibrated after the checkpointed step
            policy_generation.set_kv_scales(rng_state["kv_scales"])
        logger.print_message(f"Resumed from {last} (step {save_state.total_steps})")
    return kind(
        policy=policy,
        policy_generation=policy_generation,
        dataloader=dataloader,
        val_dataloader=val_dataloader,
        tokenizer=tokenizer,
        loss_fn=loss_fn,
        task_to_env=task_to_env,
        val_task_to_env=task_to_env if val_dataloader is not None else None,
        logger=logger,
        checkpointer=checkpointer,
        save_state=save_state,
        resumed_from=last,
        value=value,
        value_loss_fn=MseValueLossFn(cfg.value_loss_fn.scale, cfg.value_loss_fn.value_clip) if value else None,
        run_locks=run_locks,
    )


def run_banner(cfg: MasterConfig, run_dir: Path) -> str:
    """The lines printed when a run starts: where it writes, and how to follow it while it runs."""
    lines = [f"relayrl: {cfg.algorithm.upper()} run in {run_dir}"]
    if cfg.logger.tensorboard_enabled:
        lines.append(f"relayrl: follow it with: tensorboard --logdir {run_dir / 'tensorboard'}")
    return "\n".join(lines)


def weights_error(key: str, source: str, exc: Exception) -> Exception:
    """A model directory whose weights cannot be read (truncated, corrupt, wrong shapes) is the user's input: one
    line naming the key; any other failure while building the model keeps its own type and traceback."""
    unreadable = type(exc).__name__ in ("SafetensorError", "HeaderTooLarge") or isinstance(exc, (OSError, EOFError))
    unreadable = unreadable and not isinstance(exc, deadlines.DeadlineError)  # a TimeoutError, not the user's input
    if not unreadable and "size mismatch" not in str(exc):
        return exc
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ValueError(f"{key} {source}: its weights could not be loaded ({first})")


def _check_lora_checkpoint(cfg: MasterConfig, last: Path) -> None:
    """A LoRA run's checkpoint holds adapters, any other run's full weights: resuming one as the other cannot work."""
    from relayrl.models.policy.lora import is_adapter_dir

    adapters = is_adapter_dir(last / "policy" / "weights")
    if adapters != cfg.policy.lora.enabled:
        held = "LoRA adapters" if adapters else "full weights"
        raise ValueError(
            f"checkpoint {last} holds {held} but policy.lora.enabled={str(cfg.policy.lora.enabled).lower()}; resume "
            f"with policy.lora.enabled={str(adapters).lower()} or start a new run directory"
        )


def _check_value_vocabulary(cfg: MasterConfig, tokenizer: Tokenizer) -> None:
    """The critic reads the policy's token ids, so its embedding table must cover the policy tokenizer."""
    from transformers import AutoConfig

    from relayrl.utils.paths import resolve_model_path

    source = resolve_model_path(cfg.value.model_name)
    text_cfg = AutoConfig.from_pretrained(source).get_text_config()
    vocab = int(getattr(text_cfg, "vocab_size", 0) or 0)
    if vocab and vocab < len(tokenizer):
        raise ValueError(
            f"value.model_name {source} has a vocabulary of {vocab} ids but the policy tokenizer has {len(tokenizer)}; "
            "the critic must share the policy's tokenizer"
        )


def _task_names(*loaders: object) -> list[str]:
    """Task names the datasets' rows use (a Subset is unwrapped), so every one gets an environment."""
    names: list[str] = []
    for loader in loaders:
        dataset = getattr(loader, "dataset", None)
        dataset = getattr(dataset, "dataset", dataset)
        names.extend(getattr(dataset, "task_names", []))
    return names


def run_training(
    cfg: MasterConfig,
    run_dir: Path,
    inputs: UserInputs | None = None,
    *,
    new_run_dir: bool = False,
    announce: bool = False,
    resume: ResumeOptions = ResumeOptions(),
) -> dict[str, object]:
    """setup() then the trainer the config selects; returns a summary with validation accuracy before/after.
    A set-up that fails removes the run directory if this run made it (it did not exist, or `new_run_dir`: the
    caller created it empty for this run). `announce` prints `run_banner` once set-up succeeded."""
    existed = run_dir.exists() and not new_run_dir
    try:
        c = setup(cfg, run_dir, inputs, resume)
    except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, OSError) as exc:
        taken = isinstance(exc, DirectoryInUseError) and exc.directory == run_dir  # another live run's: keep it
        if not existed and not taken:
            shutil.rmtree(run_dir, ignore_errors=True)  # a set-up that failed leaves no run directory behind
        if isinstance(exc, deadlines.DeadlineError):  # a TimeoutError (so an OSError), but not bad input: exit 1
            raise
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # KeyError quotes its text
        if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT) and exc.filename:
            message = f"cannot write in {exc.filename}: {exc.strerror}"
        raise SetupError(message) from exc
    if announce:
        print(run_banner(cfg, run_dir), flush=True)
    try:
        train_components(cfg, c)
    except BaseException:
        with contextlib.suppress(Exception):  # after a failure clean-up is best effort: the first error is reported
            c.close()
        raise
    c.close()
    return summarize_run(run_dir)


def train_components(cfg: MasterConfig, c: LegacyComponents | DataPlaneComponents) -> None:
    """The trainer `cfg` selects: GRPO or PPO, through the data plane (`DataPlaneComponents`) or the driver."""
    envs, val_envs, loader, val_loader = c.task_to_env, c.val_task_to_env, c.dataloader, c.val_dataloader
    if cfg.algorithm == "ppo":
        from relayrl.algorithms.ppo import ppo_train
        from relayrl.algorithms.ppo_sync import ppo_train_sync

        assert c.value is not None and c.value_loss_fn is not None
        if isinstance(c, DataPlaneComponents):
            ppo_train_sync(
                c.policy, c.policy_generation, c.value, loader, val_loader, c.tokenizer, c.loss_fn, c.value_loss_fn,
                envs, val_envs, c.logger, c.checkpointer, c.save_state, cfg,
            )  # fmt: skip
        else:
            ppo_train(
                c.policy, c.policy_generation, c.value, loader, val_loader, c.tokenizer, c.loss_fn, c.value_loss_fn,
                envs, val_envs, c.logger, c.checkpointer, c.save_state, cfg,
            )  # fmt: skip
        return
    from relayrl.algorithms.grpo import grpo_train
    from relayrl.algorithms.grpo_async import grpo_train_async
    from relayrl.algorithms.grpo_sync import grpo_train_sync

    if isinstance(c, DataPlaneComponents):
        grpo = grpo_train_async if cfg.grpo.async_grpo.enabled else grpo_train_sync
        grpo(
            c.policy, c.policy_generation, loader, val_loader, c.tokenizer, c.loss_fn,
            envs, val_envs, c.logger, c.checkpointer, c.save_state, cfg,
        )  # fmt: skip
        return
    # the config refused async without the data plane
    grpo_train(
        c.policy, c.policy_generation, loader, val_loader, c.tokenizer, c.loss_fn,
        envs, val_envs, c.logger, c.checkpointer, c.save_state, cfg,
    )  # fmt: skip


def summarize_run(run_dir: Path) -> dict[str, object]:
    """Validation accuracy at the first and last validation in metrics.jsonl (across resumes)."""
    accs: list[tuple[int, float]] = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for row in read_jsonl(path, warn=False):
            if "validation/accuracy" in row:
                accs.append((int(row["step"]), float(row["validation/accuracy"])))
    if not accs:
        return {"run_dir": str(run_dir)}
    first, last = accs[0], accs[-1]
    return {
        "run_dir": str(run_dir),
        "first_validation": {"step": first[0], "accuracy": first[1]},
        "last_validation": {"step": last[0], "accuracy": last[1]},
        "accuracy_gain_points": 100.0 * (last[1] - first[1]),
    }

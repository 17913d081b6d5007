"""What the policy and value workers share: one data-parallel replica of a trainable model.

`ModelWorker` owns the mechanics both replicas run the same way: loading (rank 0's weights broadcast to every
rank), activation checkpointing, the data-parallel wrapper, AdamW and the LR schedule, the train() loop
(`models.optim.train_global_batches`), micro-batching (`models.microbatch` plans packed and dynamic ones), memory
phases and checkpoint save/load.
A subclass says how its network is loaded and saved and what one micro-batch's loss is. The data-plane workers add
their entry points on top and hold their store connection (`models.worker_data_plane.WorkerDataPlane`).

Workers know nothing about how they are hosted: the local executor calls them as plain objects, a Ray group as
actors. Everything that must agree across ranks goes through `self.comm`, a `Collective` (no-ops for one rank).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeAlias, TypedDict

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import PolicyConfig, SchedulerConfig, ValueConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import Collective
from relayrl.distributed.local import SingleProcessCollective
from relayrl.distributed.parallelize import wrap_model
from relayrl.models.microbatch import planned
from relayrl.models.optim import (
    MicrobatchLoss,
    TrainCall,
    all_reduce_clip_and_step,
    load_optimizer_checkpoint,
    save_optimizer_checkpoint,
    train_global_batches,
)
from relayrl.utils import device as dev
from relayrl.utils.state_file import assert_finite_state

#: transformers' loading patches process-wide state (meta-device init), so in-process workers load one at a time.
logger = logging.getLogger(__name__)

LOAD_LOCK = threading.Lock()

#: The config of a trainable replica: the keys used here are common to both.
ModelConfig: TypeAlias = PolicyConfig | ValueConfig


class ModelOptions(TypedDict, total=False):
    """How a replica starts: with an optimizer or not, from which weights and optimizer state, and the LR
    schedule's horizon. A façade passes them through to every worker unchanged."""

    init_optimizer: bool
    weights_path: str | None
    optimizer_path: str | None
    max_num_steps: int | None


class WorkerOptions(ModelOptions, total=False):
    """`ModelWorker`'s keyword options (the group sets rank and comm), for subclasses that add their own."""

    rank: int
    comm: Collective | None
    device: str


def read_hf_config(source: Path, overrides: Mapping[str, Any] | None = None, section: str = "") -> PretrainedConfig:
    """`AutoConfig` of `source` with `overrides` applied (`section` names the config block in errors)."""
    try:
        hf_config = AutoConfig.from_pretrained(source)
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"cannot read a model config from {source}: {exc}") from exc
    for key, value in (overrides or {}).items():
        if not hasattr(hf_config, key):
            raise ValueError(f"{section}.hf_config_overrides: {type(hf_config).__name__} has no attribute {key!r}")
        setattr(hf_config, key, value)
    return hf_config


def lr_factor(step: int, sched: SchedulerConfig, max_num_steps: int | None) -> float:
    """LR multiplier after `step` scheduler steps: linear warm-up, then constant or cosine to min_lr_ratio."""
    if step < sched.warmup_steps:
        return sched.warmup_start_factor + (1.0 - sched.warmup_start_factor) * step / sched.warmup_steps
    if sched.name == "constant":
        return 1.0
    horizon = sched.decay_steps or max_num_steps
    if horizon is None:
        raise ValueError("policy.scheduler.name='cosine' needs policy.scheduler.decay_steps or max_num_steps")
    progress = min(step - sched.warmup_steps, horizon) / horizon
    return sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def move_module(module: nn.Module, device: torch.device) -> None:
    """Move a module's parameters and buffers in place (a no-op when they are already there).

    Checked first because `Module.to` walks every tensor even when nothing moves, which costs milliseconds a pass.
    """
    if all(t.device == device for t in itertools.chain(module.parameters(), module.buffers())):
        return
    module.to(device)


def set_mode(module: nn.Module, training: bool) -> None:
    """`module.train(training)` only when the mode changes (the recursive walk is not free on every pass)."""
    if module.training != training:
        module.train(training)


class ModelWorker:
    """One replica of a trainable model: construction, optimizer, train(), memory phases and checkpoints."""

    #: Names the model in errors ("policy", "value model").
    owner: ClassVar[str] = "model"
    #: Use torch's fused AdamW where it has one. The critic keeps the default kernel: its results are pinned to
    #: that kernel's rounding.
    fused_adamw: ClassVar[bool] = False

    cfg: ModelConfig
    model: nn.Module

    def __init__(
        self,
        config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        rank: int = 0,
        comm: Collective | None = None,
        device: str = "auto",
        init_optimizer: bool = True,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        max_num_steps: int | None = None,
    ) -> None:
        self.cfg = config
        self.tokenizer = tokenizer
        self.rank = rank
        self.comm: Collective = comm if comm is not None else SingleProcessCollective()
        self.device = dev.select_device(device, local_rank=rank)
        self.model = self._load(weights_path)
        # One mode for the whole tree (a critic's fresh head trains while its loaded backbone is in eval mode):
        # `set_mode` reads only the top module's flag.
        self.model.train(self.model.training)
        if self.comm.world_size > 1:  # every replica starts from rank 0's weights (matters for random_init)
            for tensor in self.model.state_dict().values():
                self.comm.broadcast(tensor, src=0)
        backbone = self._backbone()
        if config.activation_checkpointing and backbone.supports_gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        move_module(self.model, self.device)
        self.weights_version = 0
        self._before_wrap()
        # `self.model` stays the plain full module every other pass reads; training runs on `self.dp.train_module`.
        self.dp = wrap_model(self.model, config.data_parallel.strategy, self.comm, self.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        # float16 trains with dynamic loss scaling (its gradients underflow otherwise); bfloat16 has float32's range.
        self.grad_scaler: torch.amp.GradScaler | None = None
        if init_optimizer and config.precision == "float16":
            self.grad_scaler = torch.amp.GradScaler(self.device.type)
        if init_optimizer:
            self._build_optimizer(max_num_steps)
        if optimizer_path is not None:
            self._load_optimizer(optimizer_path)

    # ------------------------------------------------------------------ what a subclass defines
    def _load(self, weights_path: str | None) -> nn.Module:
        """The network in float32: from `weights_path` (a checkpoint) if given, else from the config."""
        raise NotImplementedError

    def _backbone(self) -> PreTrainedModel:
        """The Hugging Face module activation checkpointing applies to."""
        raise NotImplementedError

    def _save_weights(self, path: str) -> None:
        """Write the live weights as a directory `_load` reads back."""
        raise NotImplementedError

    def valid_tokens(self, data: BatchedDataDict) -> torch.Tensor:
        """The token mask the loss averages over ([b, S] or [b, S-1])."""
        raise NotImplementedError

    def _microbatch_loss(self, loss_fn: LossFunction) -> MicrobatchLoss:
        """`loss_fn` applied to the training module's output on one micro-batch."""
        raise NotImplementedError

    def zero_loss(self, mb: BatchedDataDict) -> torch.Tensor:
        """0 x a full forward of the training module: a DDP/FSDP2 rank with nothing to learn from a micro-batch
        still joins its peers' gradient collectives (zero gradients)."""
        raise NotImplementedError

    def _before_wrap(self) -> None:
        """Runs once the loaded model is on its device, before the data-parallel wrapper may shard it."""

    # ------------------------------------------------------------------ construction helpers
    def _build_optimizer(self, max_num_steps: int | None) -> None:
        kw, sched = self.cfg.optimizer.kwargs, self.cfg.scheduler
        params = self.dp.params
        kernel = dev.adamw_kernel(params) if self.fused_adamw else {}
        self.optimizer = torch.optim.AdamW(
            params, lr=kw.lr, weight_decay=kw.weight_decay, betas=kw.betas, eps=kw.eps, **kernel
        )
        lr_factor(sched.warmup_steps, sched, max_num_steps)  # fail now, not at step N, if cosine has no horizon
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, sched, max_num_steps))

    def _load_optimizer(self, optimizer_path: str) -> None:
        self.weights_version = load_optimizer_checkpoint(
            optimizer_path, self.optimizer, self.scheduler, self.dp, self.device, self.owner, self.grad_scaler
        )

    # ------------------------------------------------------------------ pass helpers
    def _model_device(self, model: nn.Module | None = None) -> torch.device:
        return next((model or self.model).parameters()).device

    @staticmethod
    def micro_batches(data: BatchedDataDict, size: int, device: torch.device) -> Iterator[BatchedDataDict]:
        """`data` in row blocks of `size`, each moved to `device` (the training loop's plain micro-batches)."""
        for start in range(0, data.size, size):
            yield data.slice(start, min(start + size, data.size)).to(device)

    @contextlib.contextmanager
    def _mode(self, model: nn.Module, training: bool) -> Iterator[None]:
        """Switch train/eval mode for one pass and restore the caller's mode afterwards."""
        previous = model.training
        set_mode(model, training)
        try:
            yield
        finally:
            set_mode(model, previous)

    # ------------------------------------------------------------------ training
    def train(
        self, data: BatchedDataDict, loss_fn: LossFunction, eval_mode: bool, gbs: int, mbs: int
    ) -> dict[str, Any]:
        """One optimizer step per global batch of `gbs` rows (this rank holds gbs / world of them)."""
        if not eval_mode and (self.optimizer is None or self.scheduler is None):
            raise RuntimeError(f"train() needs an optimizer but the {self.owner} was built with init_optimizer=False")
        device = self._model_device()
        grad_ctx = torch.no_grad() if eval_mode else contextlib.nullcontext()
        data, plan, _ = planned(data, self.cfg, "train_mb_tokens", max(gbs // self.comm.world_size, 1))
        with self._mode(self.model, not eval_mode), grad_ctx:
            call = TrainCall(gbs=gbs, mbs=mbs, eval_mode=eval_mode, device=device, plan=plan)
            result = train_global_batches(self, data, self._microbatch_loss(loss_fn), call)
        if not eval_mode:
            dev.empty_cache(self.device, self.cfg.empty_cache_between_phases)
        return {
            **result,
            "weights_version": self.weights_version,
            "rank": self.rank,
            "model_dtype": str(dev.precision_dtype(self.cfg.precision)),
            "device": dev.device_name(self.device),
        }

    def step_optimizer(self) -> torch.Tensor:
        """Sum gradients over ranks, clip to max_grad_norm, step; returns the pre-clip global L2 norm."""
        assert self.optimizer is not None
        scaler = self.grad_scaler
        grad_norm = all_reduce_clip_and_step(
            self.dp.params, self.comm, self.optimizer, self.cfg.max_grad_norm, self.dp, scaler
        )
        if scaler is not None and getattr(scaler, "overflowed", False):
            logger.warning(
                "%s: float16 gradients overflowed; step skipped, loss scale now %g", self.owner, scaler.get_scale()
            )
        self.weights_version += 1
        return grad_norm

    # ------------------------------------------------------------------ memory phases
    def prepare_for_training(self) -> None:
        move_module(self.model, self.device)
        set_mode(self.model, True)
        if self.optimizer is not None:
            dev.move_optimizer_state(self.optimizer, self.device)
        dev.empty_cache(self.device, self.cfg.empty_cache_between_phases)

    def finish_training(self) -> None:
        set_mode(self.model, False)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _enter_inference(self, offload_optimizer: bool) -> None:
        """Weights on the device in eval mode; Adam moments to the CPU if asked (a forward pass needs none)."""
        move_module(self.model, self.device)
        set_mode(self.model, False)
        if offload_optimizer and self.optimizer is not None:
            dev.move_optimizer_state(self.optimizer, torch.device("cpu"))
        dev.empty_cache(self.device, self.cfg.empty_cache_between_phases)

    def offload_optimizer(self) -> None:
        """Adam moments to the CPU (frees the device before weights are streamed elsewhere)."""
        if self.optimizer is not None:
            dev.move_optimizer_state(self.optimizer, torch.device("cpu"))
        dev.empty_cache(self.device, self.cfg.empty_cache_between_phases)

    def offload_to_cpu(self) -> None:
        """Weights and Adam moments to the CPU (frees the device for generation)."""
        move_module(self.model, torch.device("cpu"))
        set_mode(self.model, False)
        self.offload_optimizer()

    # ------------------------------------------------------------------ weights in / out
    def get_weights_version(self) -> int:
        return self.weights_version

    def get_device(self) -> str:
        return str(self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live weights (tensors share storage with the model: no copy)."""
        return self.model.state_dict()

    def host_state_dict(self) -> dict[str, torch.Tensor]:
        """`state_dict` in host memory, for another process (a Ray driver may have no GPU, and must not open a CUDA
        context): device tensors copied to the CPU, CPU ones as they are (sending them copies them)."""
        return {k: v.detach() if v.device.type == "cpu" else v.detach().cpu() for k, v in self.state_dict().items()}

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Copy saved weights into the live module in place (its identity, shared with a colocated engine, stays)."""
        self._load_weights_in_place(weights_path)
        self.dp.load_full_into_shards()
        if optimizer_path is not None:
            self._load_optimizer(optimizer_path)  # also restores weights_version
        else:
            self.weights_version += 1  # the live weights changed: a colocated engine must notice

    def _load_weights_in_place(self, weights_path: str) -> None:
        """Copy the weights saved at `weights_path` into the live module (whatever a subclass's `_save_weights` wrote)."""
        saved = self._load(weights_path)
        self.model.load_state_dict(saved.state_dict())

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """Weights at weights_path; optimizer/scheduler state at optimizer_path; the tokenizer at tokenizer_path.

        Called on every rank (gathering fsdp2's sharded optimizer state is a collective); rank 0 writes."""
        if optimizer_path is not None:
            save_optimizer_checkpoint(
                optimizer_path,
                self.optimizer,
                self.scheduler,
                self.weights_version,
                self.dp,
                self.rank,
                self.owner,
                self.grad_scaler,
            )
        if self.rank != 0:
            return
        assert_finite_state(self.model.state_dict(), f"{self.owner} weights")  # no checkpoint ever holds NaN weights
        self._save_weights(weights_path)
        if tokenizer_path is not None:
            if self.tokenizer is None:
                raise ValueError(f"tokenizer_path was given but the {self.owner} has no tokenizer")
            self.tokenizer.save_pretrained(tokenizer_path)

    def shutdown(self) -> bool:
        self.optimizer = None
        self.scheduler = None
        return True

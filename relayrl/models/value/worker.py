"""ValueWorker: one data-parallel replica of the critic (an LM backbone plus a scalar head) and all of its compute.

The critic is `ValueModel`: the backbone of a causal LM (no LM head) and a one-output linear head at every position,
the shape of a Hugging Face token-classification head with `num_labels=1`. A fresh head is initialised like
transformers initialises that head (weights ~ N(0, initializer_range), bias 0), from a fixed seed so that every
build of the same config starts identical. The raw head output at position t summarises tokens <= t; values are
right-shifted (V[:, 0] = 0, V[:, t] = head[:, t-1]) so V[:, t] is the value of the state before token t.

Like `PolicyWorker` it knows nothing about how it is hosted; cross-rank agreement goes through `self.comm`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import Collective
from relayrl.distributed.local import SingleProcessCollective
from relayrl.distributed.parallelize import wrap_model
from relayrl.models.fast.forward import backbone_hidden_states
from relayrl.models.optim import (
    all_reduce_clip_and_step,
    load_optimizer_checkpoint,
    save_optimizer_checkpoint,
    train_global_batches,
)
from relayrl.models.policy.worker import _LOAD_LOCK, lr_factor
from relayrl.utils import device as dev
from relayrl.utils.paths import resolve_model_path

if TYPE_CHECKING:
    from relayrl.models.value.lm_value import ValueConfig

#: The head of a saved critic, next to the backbone's HF files: {"weight": [1, H], "bias": [1]}.
VALUE_HEAD_FILE = "value_head.safetensors"
HEAD_INIT_SEED = 0


class ValueModel(nn.Module):
    """Backbone + scalar head; `forward` returns the right-shifted values [B, S], 0 on padding."""

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear) -> None:
        super().__init__()
        self.model = backbone
        self.score = head

    def head_output(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        """Raw head output [B, S] (float32): position t summarises tokens <= t."""
        hidden = backbone_hidden_states(self.model, input_ids, input_lengths)  # [B, S, H]; zeros past a row's end
        return self.score(hidden).squeeze(-1).float()  # [B, S]

    def forward(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        return right_shift(self.head_output(input_ids, input_lengths), input_lengths)  # [B, S]


def right_shift(head: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """[B, S] head output -> token-aligned values [B, S]: V[:, 0] = 0, V[:, t] = head[:, t-1], 0 for t >= length."""
    shifted = torch.cat([head.new_zeros(head.shape[0], 1), head[:, :-1]], dim=1)  # [B, S]
    positions = torch.arange(head.shape[1], device=head.device)  # [S]
    return shifted.masked_fill(positions[None, :] >= input_lengths.to(head.device)[:, None], 0.0)


# ---------------------------------------------------------------------------------------------------- loading
def load_value_model(config: ValueConfig, weights_path: str | None = None) -> ValueModel:
    """The critic in float32, from `weights_path` (a saved critic) if given, else from `model_name`."""
    with _LOAD_LOCK:  # transformers' loading patches process-wide state; in-process workers load one at a time
        return _load_value_model(config, weights_path)


def _load_value_model(config: ValueConfig, weights_path: str | None) -> ValueModel:
    source = resolve_model_path(weights_path or config.model_name)  # clear FileNotFound / not-a-model errors
    is_critic = (source / VALUE_HEAD_FILE).is_file()
    if weights_path is not None and not is_critic:
        raise ValueError(f"weights_path {source} is not a saved value model (no {VALUE_HEAD_FILE})")
    try:
        hf_config = AutoConfig.from_pretrained(source)
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"cannot read a model config from {source}: {exc}") from exc
    for key, value in config.hf_config_overrides.items():
        if not hasattr(hf_config, key):
            raise ValueError(f"value.hf_config_overrides: {type(hf_config).__name__} has no attribute {key!r}")
        setattr(hf_config, key, value)
    head_state: dict[str, torch.Tensor] | None = None
    if config.random_init and weights_path is None:
        backbone = _hf_load(source, AutoModel.from_config, hf_config)
    elif is_critic:
        backbone = _hf_load(source, AutoModel.from_pretrained, source, config=hf_config)
        head_state = load_file(str(source / VALUE_HEAD_FILE))
    elif any(a.endswith("ForSequenceClassification") for a in hf_config.architectures or []):  # from a reward model
        if hf_config.num_labels != 1:
            raise ValueError(f"{source} is a classifier with num_labels={hf_config.num_labels}; a critic needs 1")
        rm = _hf_load(source, AutoModelForSequenceClassification.from_pretrained, source, config=hf_config)
        score, backbone = getattr(rm, "score", None), _backbone_of(rm, source)
        if not isinstance(score, nn.Linear):
            raise ValueError(f"{source}: {type(rm).__name__} has no linear `score` head to start the critic from")
        bias = score.bias.detach().clone() if score.bias is not None else torch.zeros(1)
        head_state = {"weight": score.weight.detach().clone(), "bias": bias}
    else:
        lm = _hf_load(source, AutoModelForCausalLM.from_pretrained, source, config=hf_config)
        backbone = _backbone_of(lm, source)
    head = nn.Linear(_hidden_size(hf_config), 1)
    with torch.no_grad():
        if head_state is not None:
            head.weight.copy_(head_state["weight"].reshape(1, -1))
            head.bias.copy_(head_state["bias"].reshape(1))
        else:
            text = hf_config.get_text_config()
            std = config.head_init_std or float(getattr(text, "initializer_range", 0.02))
            head.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(HEAD_INIT_SEED))
            head.bias.zero_()
    return ValueModel(backbone, head).float()


def _hf_load(source: Path, load: Callable[..., PreTrainedModel], *args: Any, **kwargs: Any) -> PreTrainedModel:
    """`load(*args, **kwargs)` in float32, turning transformers' assorted errors into one ValueError naming `source`."""
    try:
        return load(*args, dtype=torch.float32, **kwargs)
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"cannot load a language-model backbone from {source}: {exc}") from exc


def _backbone_of(model: PreTrainedModel, source: Path) -> PreTrainedModel:
    """The transformer under a task head (`model.base_model`); an error when the architecture has none."""
    backbone = model.base_model
    if backbone is model:
        raise ValueError(f"{source}: {type(model).__name__} exposes no separate backbone (base_model_prefix)")
    return backbone


def _hidden_size(hf_config: PretrainedConfig) -> int:
    size = getattr(hf_config.get_text_config(), "hidden_size", None)
    if not isinstance(size, int):
        raise ValueError(f"{type(hf_config).__name__} has no integer hidden_size; cannot size the value head")
    return size


def save_value_model(model: ValueModel, path: str | Path) -> None:
    """The backbone as a plain HF directory (config + safetensors) plus the head in `value_head.safetensors`."""
    path = Path(path)
    model.model.save_pretrained(path)
    head = {"weight": model.score.weight.detach().cpu().contiguous(), "bias": model.score.bias.detach().cpu()}
    save_file(head, str(path / VALUE_HEAD_FILE))


# ---------------------------------------------------------------------------------------------------- worker
class ValueWorker:
    """Holds one critic replica and runs value and train passes on its data shard."""

    def __init__(
        self,
        config: ValueConfig,
        tokenizer: Any = None,
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
        self.model = load_value_model(config, weights_path)
        if self.comm.world_size > 1:  # every replica starts from rank 0's weights (matters for random_init)
            for tensor in self.model.state_dict().values():
                self.comm.broadcast(tensor, src=0)
        if config.activation_checkpointing and self.model.model.supports_gradient_checkpointing:
            self.model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.to(self.device)
        # `self.model` stays the plain full critic every other pass reads; training runs on `self.dp.train_module`.
        self.dp = wrap_model(self.model, config.data_parallel.strategy, self.comm, self.device)
        self.weights_version = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if init_optimizer:
            kw, sched = config.optimizer.kwargs, config.scheduler
            params = self.dp.params
            self.optimizer = torch.optim.AdamW(
                params, lr=kw.lr, weight_decay=kw.weight_decay, betas=kw.betas, eps=kw.eps
            )
            lr_factor(sched.warmup_steps, sched, max_num_steps)  # fail now, not at step N, if cosine has no horizon
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda s: lr_factor(s, sched, max_num_steps)
            )
        if optimizer_path is not None:
            self._load_optimizer(optimizer_path)

    def _load_optimizer(self, optimizer_path: str) -> None:
        self.weights_version = load_optimizer_checkpoint(
            optimizer_path, self.optimizer, self.scheduler, self.dp, self.device, "value model"
        )

    # ------------------------------------------------------------------ helpers
    def _model_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _values(self, mb: BatchedDataDict, model: nn.Module | None = None) -> torch.Tensor:
        with dev.autocast(self.device, self.cfg.precision):
            return (model or self.model)(mb["input_ids"], mb["input_lengths"]).float()  # [b, S]

    @staticmethod
    def _micro_batches(data: BatchedDataDict, size: int, device: torch.device) -> Iterator[BatchedDataDict]:
        for start in range(0, data.size, size):
            yield data.slice(start, min(start + size, data.size)).to(device)

    @contextlib.contextmanager
    def _mode(self, training: bool) -> Iterator[None]:
        previous = self.model.training
        self.model.train(training)
        try:
            yield
        finally:
            self.model.train(previous)

    # ------------------------------------------------------------------ passes
    def get_values(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        mbs = micro_batch_size or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        outs = [torch.zeros(0, data["input_ids"].shape[1])]
        with self._mode(False), torch.no_grad():
            for mb in self._micro_batches(data, mbs, self._model_device()):
                outs.append(self._values(mb).cpu())  # [b, S]
        return BatchedDataDict(values=torch.cat(outs))  # [B, S]

    def train(
        self, data: BatchedDataDict, loss_fn: Callable[..., Any], eval_mode: bool, gbs: int, mbs: int
    ) -> dict[str, Any]:
        """§3.9 as for the policy: one optimizer step per global batch of `gbs` rows (gbs / world on this rank).

        The token count is Σ token_mask · sample_mask over all S positions: the value loss is not sliced with
        [:, 1:], so this is the number of tokens it actually averages over.
        """
        if not eval_mode and (self.optimizer is None or self.scheduler is None):
            raise RuntimeError("train() needs an optimizer but the value model was built with init_optimizer=False")
        device = self._model_device()
        grad_ctx = torch.no_grad() if eval_mode else contextlib.nullcontext()
        with self._mode(not eval_mode), grad_ctx:
            result = train_global_batches(
                data=data,
                gbs=gbs,
                mbs=mbs,
                eval_mode=eval_mode,
                comm=self.comm,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                params=self.dp.params,
                device=device,
                micro_batches=self._micro_batches,
                valid_tokens=lambda gb_data: gb_data["token_mask"],
                loss_for_microbatch=lambda mb, seqs, toks: loss_fn(
                    self._values(mb, self.dp.train_module), mb, seqs, toks
                ),
                step=self._reduce_clip_and_step,
                rank=self.rank,
                dp=self.dp,
                zero_loss=lambda mb: self._values(mb, self.dp.train_module).sum() * 0.0,  # DDP/FSDP2 dummy
            )
        if not eval_mode:
            dev.empty_cache(self.device)
        return {
            **result,
            "weights_version": self.weights_version,
            "rank": self.rank,
            "model_dtype": str(dev.precision_dtype(self.cfg.precision)),
            "device": dev.device_name(self.device),
        }

    def _reduce_clip_and_step(self, params: list[nn.Parameter]) -> torch.Tensor:
        """Sum gradients over ranks, clip to max_grad_norm, step; returns the pre-clip global L2 norm."""
        assert self.optimizer is not None
        grad_norm = all_reduce_clip_and_step(params, self.comm, self.optimizer, self.cfg.max_grad_norm, self.dp)
        self.weights_version += 1
        return grad_norm

    # ------------------------------------------------------------------ memory phases
    def prepare_for_training(self) -> None:
        self.model.to(self.device)
        self.model.train()
        if self.optimizer is not None:
            dev.move_optimizer_state(self.optimizer, self.device)
        dev.empty_cache(self.device)

    def prepare_for_inference(self) -> None:
        self.model.to(self.device)
        self.model.eval()
        if self.optimizer is not None:  # Adam moments are not needed for a forward pass
            dev.move_optimizer_state(self.optimizer, torch.device("cpu"))
        dev.empty_cache(self.device)

    def finish_training(self) -> None:
        self.model.eval()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def finish_inference(self) -> None:
        dev.empty_cache(self.device)

    def offload_to_cpu(self) -> None:
        self.model.to(torch.device("cpu"))
        if self.optimizer is not None:
            dev.move_optimizer_state(self.optimizer, torch.device("cpu"))
        dev.empty_cache(self.device)

    # ------------------------------------------------------------------ weights in / out
    def get_weights_version(self) -> int:
        return self.weights_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Copy a saved critic (backbone and head) into the live module in place; optionally its optimizer."""
        saved = load_value_model(self.cfg, weights_path)
        self.model.load_state_dict(saved.state_dict())
        self.dp.load_full_into_shards()
        if optimizer_path is not None:
            self._load_optimizer(optimizer_path)  # also restores weights_version
        else:
            self.weights_version += 1

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """Backbone HF directory + value head at weights_path; optimizer/scheduler state at optimizer_path.

        Called on every rank (gathering fsdp2's sharded optimizer state is a collective); rank 0 writes."""
        if optimizer_path is not None:
            save_optimizer_checkpoint(
                optimizer_path, self.optimizer, self.scheduler, self.weights_version, self.dp, self.rank, "value model"
            )
        if self.rank != 0:
            return
        save_value_model(self.model, weights_path)
        if tokenizer_path is not None:
            if self.tokenizer is None:
                raise ValueError("tokenizer_path was given but the value model has no tokenizer")
            self.tokenizer.save_pretrained(tokenizer_path)

    def shutdown(self) -> bool:
        self.optimizer = None
        self.scheduler = None
        return True

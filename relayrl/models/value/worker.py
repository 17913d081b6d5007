"""ValueWorker: one data-parallel replica of the critic (an LM backbone plus a scalar head) and all of its compute.

The critic is `ValueModel`: the backbone of a causal LM (no LM head) and a one-output linear head at every position,
the shape of a Hugging Face token-classification head with `num_labels=1`. A fresh head is initialised like
transformers initialises that head (weights ~ N(0, initializer_range), bias 0), from a fixed seed so that every
build of the same config starts identical. The raw head output at position t summarises tokens <= t; values are
right-shifted (V[:, 0] = 0, V[:, t] = head[:, t-1]) so V[:, t] is the value of the state before token t.

The replica mechanics it shares with `PolicyWorker` (optimizer, train(), memory phases, checkpoints) live in
`models.worker_base.ModelWorker`; here are the critic network, its files and its micro-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import ValueConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.fast.forward import backbone_hidden_states
from relayrl.models.microbatch import pass_batches, place
from relayrl.models.worker_base import LOAD_LOCK, MicrobatchLoss, ModelWorker, read_hf_config
from relayrl.utils import device as dev
from relayrl.utils.paths import resolve_model_path

#: The head of a saved critic, next to the backbone's HF files: {"weight": [1, H], "bias": [1]}.
VALUE_HEAD_FILE = "value_head.safetensors"
HEAD_INIT_SEED = 0


class ValueModel(nn.Module):
    """Backbone + scalar head; `forward` returns the right-shifted values [B, S], 0 on padding."""

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear) -> None:
        super().__init__()
        self.model = backbone
        self.score = head

    def head_output(self, input_ids: torch.Tensor, input_lengths: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """Raw head output [B, S] (float32): position t summarises tokens <= t (`packed`: the rows run as one packed
        stream, each sequence attending to its own tokens; sequence packing)."""
        hidden = backbone_hidden_states(self.model, input_ids, input_lengths, packed=packed)  # [B, S, H]
        return self.score(hidden).squeeze(-1).float()  # [B, S]

    def forward(self, input_ids: torch.Tensor, input_lengths: torch.Tensor, packed: bool = False) -> torch.Tensor:
        return right_shift(self.head_output(input_ids, input_lengths, packed), input_lengths)  # [B, S]


def right_shift(head: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """[B, S] head output -> token-aligned values [B, S]: V[:, 0] = 0, V[:, t] = head[:, t-1], 0 for t >= length."""
    shifted = torch.cat([head.new_zeros(head.shape[0], 1), head[:, :-1]], dim=1)  # [B, S]
    positions = torch.arange(head.shape[1], device=head.device)  # [S]
    return shifted.masked_fill(positions[None, :] >= input_lengths.to(head.device)[:, None], 0.0)


# ---------------------------------------------------------------------------------------------------- loading
def load_value_model(config: ValueConfig, weights_path: str | None = None) -> ValueModel:
    """The critic in float32, from `weights_path` (a saved critic) if given, else from `model_name`."""
    with LOAD_LOCK:  # transformers' loading patches process-wide state; in-process workers load one at a time
        return _load_value_model(config, weights_path)


def _load_value_model(config: ValueConfig, weights_path: str | None) -> ValueModel:
    source = resolve_model_path(weights_path or config.model_name)  # clear FileNotFound / not-a-model errors
    is_critic = (source / VALUE_HEAD_FILE).is_file()
    if weights_path is not None and not is_critic:
        raise ValueError(f"weights_path {source} is not a saved value model (no {VALUE_HEAD_FILE})")
    hf_config = read_hf_config(source, config.hf_config_overrides, "value")
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
    if backbone is model or not isinstance(backbone, PreTrainedModel):
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
class ValueWorker(ModelWorker):
    """Holds one critic replica and runs value and train passes on its data shard."""

    owner = "value model"
    cfg: ValueConfig
    model: ValueModel

    def _load(self, weights_path: str | None) -> ValueModel:
        return load_value_model(self.cfg, weights_path)

    def _backbone(self) -> PreTrainedModel:
        return self.model.model

    def _save_weights(self, path: str) -> None:
        save_value_model(self.model, path)

    def _values(self, mb: BatchedDataDict, model: nn.Module | None = None) -> torch.Tensor:
        packed = self.cfg.sequence_packing.enabled
        with dev.autocast(self.device, self.cfg.precision):
            return (model or self.model)(mb["input_ids"], mb["input_lengths"], packed=packed).float()  # [b, S]

    # ------------------------------------------------------------------ passes
    def get_values(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        mbs = micro_batch_size or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        out = torch.zeros(data["input_ids"].shape)  # [B, S]
        with self._mode(self.model, False), torch.no_grad():
            for rows, mb in pass_batches(data, self.cfg, mbs, self._model_device()):
                place(out, rows, self._values(mb).cpu())  # [b, S], or [b, w] under packing / dynamic batching
        return BatchedDataDict(values=out)  # [B, S]

    # ------------------------------------------------------------------ training (the loop is ModelWorker.train)
    def valid_tokens(self, data: BatchedDataDict) -> torch.Tensor:
        """All S positions: the value loss is not sliced with [:, 1:], so Σ token_mask · sample_mask is the number
        of tokens it actually averages over."""
        return data["token_mask"]  # [b, S]

    def _microbatch_loss(self, loss_fn: LossFunction) -> MicrobatchLoss:
        return lambda mb, seqs, toks: loss_fn(self._values(mb, self.dp.train_module), mb, seqs, toks)

    def zero_loss(self, mb: BatchedDataDict) -> torch.Tensor:
        return self._values(mb, self.dp.train_module).sum() * 0.0

    # ------------------------------------------------------------------ memory phases (plus ModelWorker's)
    def prepare_for_inference(self) -> None:
        self._enter_inference(offload_optimizer=True)

    def finish_inference(self) -> None:
        dev.empty_cache(self.device, self.cfg.empty_cache_between_phases)

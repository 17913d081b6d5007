"""LoRA adapters on the policy (`policy.lora`, through `peft`): the base weights stay frozen, only the adapters train.

The adapters are injected into the policy's own Hugging Face module in place, so every pass keeps reading
`worker.model` (its `base_model`, `get_output_embeddings()`, ...) unchanged; what changes is what leaves the worker:

* checkpoints hold the adapters alone, as a `peft` adapter directory (`adapter_config.json`,
  `adapter_model.safetensors`), and the optimizer holds state for the adapter tensors alone;
* the reference policy is the same module with the adapters switched off (`reference_mode`): no second copy;
* generation gets plain Hugging Face weights with every adapter merged in (W + B @ A * alpha / rank), under the
  names of the base model: refit streams them tensor by tensor (`merged_named_tensors`), and the local executor's
  colocated engine reads a plain module refreshed from them whenever the policy's `weights_version` moves
  (`MergedGenerationSource`), so the generation fast path still applies.

The policy's full-sequence passes keep the fast path, which computes a LoRA projection as peft does (base output,
plus (x A^T) B^T scaled); with `dropout` > 0 the training passes go through Hugging Face's forward instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relayrl.config import PolicyConfig

#: The file names of a peft adapter directory; the config file marks a weights directory as adapters only.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The adapter name peft uses when none is given.
ADAPTER = "default"


def fast_path_note(cfg: PolicyConfig) -> str | None:
    """The one line a run prints when LoRA keeps its training passes off the fast path, else None."""
    if cfg.lora.enabled and cfg.lora.dropout > 0:
        return (
            f"policy.lora.dropout={cfg.lora.dropout}: the policy's training passes run through Hugging Face's forward "
            "(the fast path reproduces LoRA without dropout); log-prob passes and generation keep it"
        )
    return None


def peft_missing_message() -> str | None:
    """One line naming the extra when `peft` is not installed, else None."""
    if importlib.util.find_spec("peft") is None:
        return "policy.lora.enabled=true needs the peft package, which is not installed: pip install 'relayrl[lora]'"
    return None


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` is a peft adapter directory (a LoRA run's checkpointed weights)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def add_adapters(model: nn.Module, cfg: PolicyConfig) -> Any:
    """Inject LoRA adapters into `model` in place (base weights frozen; lora_B starts at zero, so the policy starts
    as the base model) and return the `peft.PeftModel` around it (it saves, loads and switches the adapters)."""
    problem = peft_missing_message()
    if problem is not None:
        raise ValueError(problem)
    from peft import LoraConfig, get_peft_model

    lora = cfg.lora
    peft_cfg = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # annotated int; peft divides it by r as a float
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        # lora_A's random start from its own seed, not the process's RNG: every executor and rank (a Ray actor's RNG
        # is not the driver's) starts from the same adapters, and the run's other random streams are left untouched
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
            torch.manual_seed(lora.init_seed)
            peft_model = get_peft_model(model, peft_cfg)
    except ValueError as exc:  # e.g. target modules not found in the model
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"policy.lora.target_modules {lora.target_modules!r}: {first}") from None
    for name, layer in _lora_layers(model).items():  # merging (generation, export) is written for linear layers
        if type(layer.base_layer) is not nn.Linear:
            raise ValueError(
                f"policy.lora.target_modules {lora.target_modules!r} adapts {name}, a "
                f"{type(layer.base_layer).__name__}; only linear layers are supported (e.g. all-linear)"
            )
    return peft_model


@contextlib.contextmanager
def reference_mode(peft_model: Any) -> Iterator[None]:
    """The base model: every adapter off for the duration (the reference policy of the KL term)."""
    with peft_model.disable_adapter():
        yield


def _lora_layers(model: nn.Module) -> dict[str, Any]:
    """Module name -> peft LoRA layer (a wrapped `base_layer` with `lora_A` / `lora_B`)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def plain_name(name: str) -> str:
    """A LoRA module's state-dict name as the base model names it (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def merged_named_tensors(model: nn.Module, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's state dict (its names, its order) with every adapter merged into its weight, one tensor at a
    time (a merged weight is a fresh tensor; the others are the live ones). `merge=False`: the names and shapes only
    matter (the unmerged base weights are yielded)."""
    layers = _lora_layers(model)
    merged_weights = {f"{name}.base_layer.weight": layer for name, layer in layers.items()}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if ".lora_" in name:
                continue
            layer = merged_weights.get(name)
            if merge and layer is not None and ADAPTER in layer.lora_A:
                tensor = tensor + layer.get_delta_weight(ADAPTER).to(tensor.dtype)
            yield plain_name(name), tensor


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's file names (what `adapter_model.safetensors` holds)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model)


def save_adapters(peft_model: Any, path: str | Path) -> None:
    """Write the adapters as a peft adapter directory (config + safetensors; the base weights are not written)."""
    from safetensors.torch import save_file

    Path(path).mkdir(parents=True, exist_ok=True)
    peft_model.peft_config[ADAPTER].save_pretrained(str(path))
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(peft_model).items()}
    save_file(tensors, str(Path(path) / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def load_adapters(peft_model: Any, path: str | Path) -> None:
    """Copy the adapter tensors saved at `path` into the live adapters, in place; every one must be present."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ValueError(f"{path} is not a LoRA adapter checkpoint (no {ADAPTER_WEIGHTS})")
    saved = load_file(str(file))
    expected = adapter_state_dict(peft_model)
    if set(saved) != set(expected):
        missing = sorted(set(expected) - set(saved)) or sorted(set(saved) - set(expected))
        raise ValueError(
            f"{file}: its adapters do not match policy.lora (e.g. {missing[0]!r}); resume with the run's own lora config"
        )
    for name, tensor in saved.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{file}: {name} has shape {tuple(tensor.shape)}, policy.lora makes {tuple(expected[name].shape)}; "
                "resume with the run's own policy.lora.rank"
            )
    set_peft_model_state_dict(peft_model, saved)


class MergedGenerationSource:
    """What a colocated engine reads under LoRA: a plain module (the base architecture, no adapters) holding the merged
    weights, re-merged from the live adapters whenever the policy's `weights_version` moved since the last read.

    Only the adapted weights get storage of their own: every other parameter (embeddings, norms, biases, the head) is
    the live module's own tensor, which LoRA never changes."""

    def __init__(self, worker: Any, build_plain: Callable[[], nn.Module]) -> None:
        self._worker = worker  # .model (with adapters), .weights_version, .device
        self._build_plain = build_plain
        self._plain: nn.Module | None = None
        self._merged_names: set[str] = set()
        self._version: int | None = None

    @property
    def weights_version(self) -> int:
        return int(self._worker.weights_version)

    def _build(self) -> nn.Module:
        plain = self._build_plain().requires_grad_(False).eval()
        plain.to(self._worker.device)
        live = self._worker.model
        self._merged_names = {f"{name}.weight" for name in _lora_layers(live)}
        shared = {plain_name(n): p for n, p in live.named_parameters(remove_duplicate=False) if ".lora_" not in n}
        params = dict(plain.named_parameters(remove_duplicate=False))  # tied weights: every name of the tensor
        merged = {params[n].data_ptr() for n in self._merged_names if n in params}  # a weight tied to a merged one
        for name, param in params.items():
            if name in shared and param.data_ptr() not in merged:
                owner, _, attr = name.rpartition(".")
                setattr(plain.get_submodule(owner), attr, shared[name])
        return plain

    @property
    def model(self) -> nn.Module:
        version = self.weights_version
        if self._plain is None:
            self._plain = self._build()
        if self._version != version:
            target = self._plain.state_dict()
            with torch.no_grad():
                for name, tensor in merged_named_tensors(self._worker.model):
                    if name in self._merged_names:
                        target[name].copy_(tensor)
            self._version = version
        return self._plain

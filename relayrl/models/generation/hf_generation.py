"""Hugging Face generation backend: batched KV-cache sampling for any causal LM, fast on CPU.

`model.generate` spends most of a small model's decode step in Python: logits processors, stopping criteria, cache
objects and mask construction. This engine runs its own decode loop instead: inference mode, a preallocated KV
cache, sampling by inverse CDF, one host sync per step, and finished rows dropped from the batch once enough of them
are done. Llama-family models (llama, mistral, qwen2, qwen3) go through `FastDecoder`, a forward pass written against
the model's own weight tensors (read in place, no copy); anything else runs through the model's HF forward with a
`DynamicCache`. Ragged right-padded prompts are left-padded internally (position ids count real tokens only) and
the results are mapped back to the right-padded layout of `GenerationOutputSpec`.

With `kv_cache_dtype=fp8` the cache holds float8 e4m3 values with per-layer scales (`fp8_kv`): the calibrated ones
handed to `set_kv_scales`, else 1.0 (logged once). `precision` bfloat16 / float16: decode from a copy of the
projection weights in that dtype (`ComputeWeights`), refreshed whenever the engine's weights move, with a KV cache
in that dtype; the HF fallback runs its forward under autocast. float32 decodes from the module itself.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from relayrl.config import GenerationConfig
from relayrl.distributed import refit_digest, refit_manifest
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models import fp8_kv
from relayrl.models.fast.compute_weights import ComputeWeights
from relayrl.models.fast.decoder import FastDecoder, HfDecoder
from relayrl.models.fast.support import fast_path_unsupported
from relayrl.models.generation.digests import module_digests, verify_engine
from relayrl.models.generation.interfaces import GenerationDatumSpec, GenerationInterface, GenerationOutputSpec
from relayrl.models.generation.outputs import assemble_output, empty_generation, generation_limits
from relayrl.models.generation.sampling import StopStringMatcher, TokenSampler, stop_test, support_output
from relayrl.utils import device as dev

#: Drop finished rows from the live batch (KV cache included) once at most this fraction of it is still running.
COMPACT_WHEN_ALIVE_FRACTION = 0.75

logger = logging.getLogger(__name__)


class ModelSource(Protocol):
    """What the engine reads weights from: the policy's live module and its optimizer-step counter."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def weights_version(self) -> int: ...


class HfGeneration(GenerationInterface):
    """Generation engine over a Hugging Face causal LM (colocated: the policy's own module; else a private copy)."""

    def __init__(
        self,
        config: GenerationConfig,
        tokenizer: Any,
        model_source: ModelSource,
        *,
        device: str | torch.device = "cpu",
        max_total_sequence_length: int | None = None,
        seed: int = 0,
        fast_path: bool | None = None,
        precision: str = "float32",
    ) -> None:
        if not isinstance(config, GenerationConfig):
            raise TypeError(f"config must be a relayrl GenerationConfig, got {type(config).__name__}")
        if not hasattr(model_source, "model") or not hasattr(model_source, "weights_version"):
            raise TypeError("model_source must have `.model` (an HF causal LM) and `.weights_version` (int)")
        if max_total_sequence_length is not None and max_total_sequence_length < 2:
            raise ValueError(f"max_total_sequence_length must be >= 2, got {max_total_sequence_length}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError("tokenizer has neither pad_token_id nor eos_token_id; cannot pad outputs")
        eos_id = tokenizer.eos_token_id
        stop_ids = (
            config.stop_token_ids if config.stop_token_ids is not None else [eos_id] if eos_id is not None else []
        )
        for s in config.stop_strings or []:
            if not s:
                raise ValueError("generation.stop_strings may not contain an empty string")
        self.config = config
        self.tokenizer = tokenizer
        self.max_total_sequence_length = max_total_sequence_length
        self.pad_token_id = int(pad_id)
        self.stop_token_ids = [int(t) for t in stop_ids]
        self._source = model_source
        self._colocated = config.colocated.enabled
        self._fast_path = fast_path
        self._own_model: nn.Module | None = None
        if self._colocated:
            self._device = _module_device(model_source.model)
        else:
            self._device = torch.device(device)
            self._own_model = _private_copy(model_source.model, self._device)
        self._synced_version = int(model_source.weights_version)
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._restore_training: bool | None = None
        self._closed = False
        self._kv_scales: dict[str, float] | None = None  # calibrated FP8 scales (kv_cache_dtype=fp8)
        self._warned_unit_scales = False
        dtype = dev.precision_dtype(precision)
        self.precision = precision
        self.compute_weights = None if dtype == torch.float32 else ComputeWeights(dtype)
        self._loads = 0  # weight loads into the engine's module (a refit may keep the version number)
        self.verify_against: Callable[[list[str]], refit_digest.Digests] | None = None  # the trainer's digests
        self.trainer_storage: Callable[[], set[int]] | None = None  # data pointers of the trainer's own tensors
        _ = self.uses_fast_path  # fail early when fast_path=True cannot be honoured

    # ------------------------------------------------------------------ state
    @property
    def model(self) -> nn.Module:
        """The module generation runs on: the policy's own (colocated) or the engine's copy."""
        if self._closed:
            raise RuntimeError("generation engine is shut down")
        return self._source.model if self._colocated else self._own_model  # type: ignore[return-value]

    @property
    def synced_weights_version(self) -> int:
        """The policy weights_version the engine last synced to; generate() refuses to run on any other."""
        return self._synced_version

    @property
    def uses_fast_path(self) -> bool:
        """Whether generation runs through FastDecoder (else the model's HF forward)."""
        reason = fast_path_unsupported(self.model, lm_head=True)
        if self._fast_path and reason is not None:
            raise ValueError(f"fast_path=True but this model cannot use it: {reason}")
        return self._fast_path is not False and reason is None

    @property
    def requires_kv_scale_sync(self) -> bool:
        """Whether the cache is FP8 (`kv_cache_dtype=fp8`), so calibrated scales should follow every refit."""
        return self.config.kv_cache_dtype == "fp8"

    @property
    def kv_scales(self) -> dict[str, float] | None:
        """The FP8 scales in use (a copy; None before any were set)."""
        return None if self._kv_scales is None else dict(self._kv_scales)

    def set_kv_scales(self, kv_scales: Mapping[str, float] | None) -> None:
        """Use these FP8 KV-cache scales (a calibration's `layers` dict; q scales are ignored) from the next
        generate() on; None goes back to unit scales. Checked against the model's layer count."""
        if kv_scales is not None:
            fp8_kv.kv_cache_scales(kv_scales, fp8_kv.num_layers(self.model))
        self._kv_scales = None if kv_scales is None else {str(k): float(v) for k, v in kv_scales.items()}

    def _cache_scales(self, model: nn.Module) -> list[tuple[float, float]] | None:
        """(k_scale, v_scale) per layer for an FP8 cache; None for a cache in the model's dtype."""
        if not self.requires_kv_scale_sync:
            return None
        num_layers = fp8_kv.num_layers(model)
        if self._kv_scales is None:
            if not self._warned_unit_scales:
                logger.warning("kv_cache_dtype=fp8 without calibrated scales: using 1.0 (set_kv_scales to calibrate)")
                self._warned_unit_scales = True
            return [(1.0, 1.0)] * num_layers
        return fp8_kv.kv_cache_scales(self._kv_scales, num_layers)

    def get_rng_state(self) -> torch.Tensor:
        """Sampling generator state (save it with a checkpoint for an exact resume)."""
        return self._generator.get_state().clone()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state from get_rng_state()."""
        self._generator.set_state(state.clone())

    # ------------------------------------------------------------------ lifecycle
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Sync to the policy's current weights (copy them when not colocated) and switch the model to eval mode."""
        model = self.model
        version = int(self._source.weights_version)
        if not self._colocated and version != self._synced_version:
            with torch.no_grad():
                model.load_state_dict(self._source.model.state_dict())
            self._loads += 1
        self._synced_version = version
        if self._restore_training is None:
            self._restore_training = model.training
            model.eval()
        if self.verify_against is not None:  # policy.generation.refit_verify: the trainer's weights, or one line
            verify_engine(self.weight_digests, self.verify_against, self.config.refit_verify, version)
        return True

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Refit this engine's private copy from a snapshot of the policy's weights taken at `version` (an
        asynchronous producer generates on an older version than the policy's live one). The caller's model
        source must then report `version`, which generate() checks. A snapshot that matches the module (names,
        shapes, dtypes, device) becomes its weights without a copy (the caller does not write it afterwards)."""
        if self._colocated:
            raise RuntimeError("load_weights needs a non-colocated engine (a colocated one reads the live weights)")
        if not refit_manifest.adopt_into_module(self.model, state):  # the snapshot is this engine's from now on
            with torch.no_grad():
                self.model.load_state_dict(state)
        self._loads += 1
        self._synced_version = int(version)

    def weights_changed(self) -> None:
        """Someone wrote new weights into the engine's module in place (a refit receiver): refresh the compute copy
        before the next generate() even if the weights version number did not move."""
        self._loads += 1

    def _weights_key(self, model: nn.Module) -> object:  # the compute copies follow any change of it
        return (id(model), self._synced_version, self._loads)

    def weight_digests(self, delivered: torch.dtype | None = None) -> refit_digest.Digests:
        """Digests of what the next generate() reads (`module_digests`; compute copies refreshed as it would)."""
        model, copies = self.model, None
        if self.compute_weights is not None and self.uses_fast_path:
            self.compute_weights.refresh(model, self._weights_key(model))
            copies = self.compute_weights.copies()
        shared = self.trainer_storage() if self.trainer_storage is not None else None
        return module_digests(model, copies, self._kv_scales, delivered, shared)

    def worker_digests(self) -> list[refit_digest.Digests]:
        return [self.weight_digests()]

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Restore the train/eval mode found at prepare time. Cached device memory stays with torch's allocator (the
        next step reuses it); the policy releases it between phases only if `policy.empty_cache_between_phases`."""
        if self._restore_training is not None and not self._closed:
            self.model.train(self._restore_training)
        self._restore_training = None
        return True

    def shutdown(self) -> bool:
        if not self._closed:
            self.finish_generation()
            self._own_model = None
            self._closed = True
        return True

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        greedy: bool = False,
        *,
        seed: int | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Sample a continuation for every row; `seed` reseeds the engine's generator first.

        Sampling draws `U = rand(B, N)` up front (N = the batch's token budget) and step s of row r uses U[r, s], so
        a row's tokens depend only on its prompt, the weights and U[r]. `uniforms` [B, >= N] supplies U instead
        (a driver draws it once for a whole batch and hands each worker its rows); ignored when greedy.
        """
        model = self.model
        version = int(self._source.weights_version)
        if version != self._synced_version:
            raise RuntimeError(
                f"stale weights: engine synced to weights_version {self._synced_version} but the policy is at "
                f"{version}; call prepare_for_generation() first"
            )
        device = _module_device(model)
        if device.type != self._generator.device.type:
            raise RuntimeError(
                f"the model is on {device} but the engine was built for {self._generator.device}; "
                "build the engine where the policy generates"
            )
        input_ids, lengths, row_stops = self._validate(data)
        batch, width = input_ids.shape
        limits = generation_limits(lengths, self.config.max_new_tokens, self.max_total_sequence_length)  # [B]
        max_new = int(limits.max()) if batch else self.config.max_new_tokens
        if batch == 0:
            return assemble_output(input_ids, lengths, *empty_generation(max_new), self.pad_token_id)
        if seed is not None:
            self._generator.manual_seed(seed)
        if greedy:
            uniforms = None
        elif uniforms is None:  # one draw per row and step, up front: independent of how rows are batched
            uniforms = torch.rand((batch, max_new), generator=self._generator, device=self._generator.device)
        elif uniforms.dim() != 2 or uniforms.shape[0] != batch or uniforms.shape[1] < max_new:
            raise ValueError(f"uniforms must be a float tensor [{batch}, >= {max_new}], got {list(uniforms.shape)}")
        sampler = TokenSampler(
            temperature=self.config.temperature,
            top_k=self.config.top_k,
            top_p=self.config.top_p,
            greedy=greedy,
            generator=None if greedy else self._generator,
            native=self.config.native_cpu_decode and device.type == "cpu",
            record_support=self.config.support_width,
        )
        if self.compute_weights is not None and self.uses_fast_path:
            self.compute_weights.refresh(model, self._weights_key(model))
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode(), self._autocast(device):
                result = self._decode(
                    model,
                    input_ids.to(device),
                    lengths.to(device),
                    limits.to(device),
                    sampler,
                    row_stops,
                    None if uniforms is None else uniforms[:, :max_new].to(device, torch.float32),
                )
        finally:
            model.train(was_training)
        tokens, logprobs, gen_len, stopped = (t.cpu() for t in result[:4])
        out = assemble_output(input_ids, lengths, tokens, logprobs, gen_len, stopped, self.pad_token_id)
        if result[4] is not None:  # the sampler's kept sets (top-k / top-p): in the output's columns
            out["support"] = support_output(lengths, width, result[4].cpu(), gen_len)
        return out

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """The HF fallback's forward in the compute precision (the fast path uses `compute_weights` instead)."""
        if self.compute_weights is None or self.uses_fast_path:
            return contextlib.nullcontext()
        return dev.autocast(device, self.precision)

    def _validate(
        self, data: BatchedDataDict[GenerationDatumSpec]
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
        """Check the request and return (input_ids [B, S] CPU, input_lengths [B] CPU, stop strings per row)."""
        for key in ("input_ids", "input_lengths"):
            if key not in data:
                raise ValueError(f"generate() input is missing {key!r}")
        input_ids, lengths = data["input_ids"], data["input_lengths"]
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(
                f"input_ids must be an integer tensor [B, S], got {getattr(input_ids, 'shape', input_ids)}"
            )
        lengths = torch.as_tensor(lengths).cpu()
        batch, width = input_ids.shape
        if lengths.shape != (batch,) or lengths.is_floating_point():
            raise ValueError(f"input_lengths must be an integer tensor [{batch}], got shape {tuple(lengths.shape)}")
        bad = ((lengths < 1) | (lengths > width)).nonzero()
        if bad.numel():
            row = int(bad[0])
            raise ValueError(f"input_lengths[{row}]={int(lengths[row])} is outside [1, {width}] (input_ids width)")
        per_row = data.get("stop_strings")
        if per_row is not None and len(per_row) != batch:
            raise ValueError(f"stop_strings has {len(per_row)} entries for {batch} rows")
        common = list(self.config.stop_strings or [])
        row_stops = []
        for i in range(batch):
            extra = per_row[i] if per_row is not None and per_row[i] is not None else []
            if not isinstance(extra, (list, tuple)) or any(not isinstance(s, str) or not s for s in extra):
                raise ValueError(f"stop_strings[{i}] must be None or a list of non-empty strings, got {extra!r}")
            row_stops.append(list(dict.fromkeys(common + list(extra))))
        return input_ids.cpu().long(), lengths.long(), row_stops

    def _decode(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        limits: torch.Tensor,
        sampler: TokenSampler,
        row_stops: list[list[str]],
        uniforms: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decode loop. Returns (tokens [B, N], logprobs [B, N], generation lengths [B], stopped [B], the
        sampler's kept sets [B, N, K] when it records them, else None).

        `uniforms` [B, N]: step s of original row r samples with U[r, s] (None when greedy)."""
        batch = input_ids.shape[0]
        device = input_ids.device
        n_max = int(limits.max())
        left_ids, key_valid, positions = _left_pad(input_ids, lengths, self.pad_token_id)  # [B, P] each
        prompt_cols = left_ids.shape[1]
        scales = self._cache_scales(model)
        if self.uses_fast_path:
            decoder: FastDecoder | HfDecoder = FastDecoder(
                model, native=self.config.native_cpu_decode, kv_scales=scales, compute=self.compute_weights
            )
        else:
            decoder = HfDecoder(model, kv_scales=scales)
        # GRPO repeats each prompt: prefill each distinct prompt once and fan its cache out to the repeats.
        unique, inverse = torch.unique(torch.cat([left_ids, key_valid.long()], 1), dim=0, return_inverse=True)
        if unique.shape[0] < batch:
            first = torch.full((unique.shape[0],), batch, dtype=torch.long, device=device)
            first.scatter_reduce_(0, inverse, torch.arange(batch, device=device), reduce="amin")
            logits = decoder.start(left_ids[first], key_valid[first], positions[first], prompt_cols + n_max)
            logits = logits.index_select(0, inverse)  # [B, V]
            decoder.select(inverse)
        else:
            logits = decoder.start(left_ids, key_valid, positions, prompt_cols + n_max)  # [B, V]

        tokens = torch.full((n_max, batch), self.pad_token_id, dtype=torch.long, device=device)  # [N, B]
        logprobs = torch.zeros((n_max, batch), dtype=torch.float32, device=device)  # [N, B]
        k = sampler.record_support  # [N, B, K] kept sets when the sampler records them
        support = torch.zeros((n_max, batch, k), dtype=torch.int32, device=device) if k else None
        gen_len = torch.zeros(batch, dtype=torch.long, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        is_stop = stop_test(self.stop_token_ids, device)
        matcher = StopStringMatcher(self.tokenizer, row_stops) if any(row_stops) else None
        rows = torch.arange(batch, device=device)  # original row of each live slot
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        live_limits, pos = limits.clone(), lengths.clone()  # per slot: token budget, next position id
        n_alive, all_rows = batch, True
        first_limit = int(live_limits.min())  # no row can reach its token budget before this step
        for step in range(n_max):
            if uniforms is None:
                u = None
            else:  # compacted slots keep their original row's stream
                u = uniforms[:, step] if all_rows else uniforms[:, step].index_select(0, rows)  # [b]
            tok, lp = sampler(logits, u)  # [b], [b]
            # select + copy_ rather than `tokens[step] = tok`: same values, less per-step indexing dispatch.
            if all_rows:
                tokens.select(0, step).copy_(tok)
                logprobs.select(0, step).copy_(lp)
            else:
                tokens.select(0, step).index_copy_(0, rows, tok)
                logprobs.select(0, step).index_copy_(0, rows, lp)
            if support is not None and sampler.last_support is not None:
                support.select(0, step).index_copy_(0, rows, sampler.last_support)
            hit = is_stop(tok)  # [b]
            if matcher is not None:
                hit |= matcher.check(rows, tok, alive)
            ended = hit | (live_limits <= step + 1) if step + 1 >= first_limit else hit  # [b]
            if n_alive < alive.shape[0]:
                ended &= alive  # ended rows decode on until the next compaction, but end only once
            n_ended = int(ended.sum())  # the one host sync per step
            if n_ended:
                ended_rows = rows[ended]
                gen_len[ended_rows] = step + 1
                stopped[ended_rows] = hit[ended]
                n_alive -= n_ended
                if n_alive == 0:
                    break
                alive &= ~ended
                if n_alive <= COMPACT_WHEN_ALIVE_FRACTION * alive.shape[0]:
                    keep = alive.nonzero().squeeze(1)
                    rows, tok, pos, alive = rows[keep], tok[keep], pos[keep], alive[keep]
                    live_limits = live_limits[keep]
                    decoder.select(keep)
                    all_rows = False
            logits = decoder.step(tok, pos, prompt_cols + step)  # [b, V]
            pos += 1
        return tokens.T, logprobs.T, gen_len, stopped, None if support is None else support.transpose(0, 1)


def _left_pad(
    input_ids: torch.Tensor, lengths: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [B, S] -> left-padded (ids [B, P], key_valid [B, P], position ids [B, P]) with P = max length."""
    cols = int(lengths.max())
    shift = (cols - lengths).unsqueeze(1)  # [B, 1]
    src = torch.arange(cols, device=input_ids.device).unsqueeze(0) - shift  # [B, P]
    key_valid = src >= 0
    left_ids = input_ids.gather(1, src.clamp(min=0)).masked_fill_(~key_valid, pad_id)
    return left_ids, key_valid, src.clamp(min=0)


def _module_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _private_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """A real copy of the policy module for a non-colocated engine (no grads, eval mode)."""
    clone = copy.deepcopy(model).to(device)
    for param in clone.parameters():
        param.grad = None
    return clone.requires_grad_(False).eval()

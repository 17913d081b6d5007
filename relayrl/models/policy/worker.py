"""PolicyWorker: one data-parallel replica of the policy and all of its compute.

A worker owns the live model (float32 master weights), an optional frozen reference copy, the optimizer and the
LR schedule. It knows nothing about how it is hosted: the local executor calls it as a plain object, a Ray group
would call it as an actor. Everything that must agree across data-parallel ranks (global valid counts, gradients,
losses, calibration maxima) goes through `self.comm`, a `Collective`; with one rank those calls are no-ops.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from relayrl.config import PolicyConfig, SchedulerConfig
from relayrl.distributed import refit
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import Collective
from relayrl.distributed.local import SingleProcessCollective
from relayrl.distributed.parallelize import wrap_model
from relayrl.models.fast.forward import backbone_hidden_states, selected_hidden_states
from relayrl.models.optim import (
    all_reduce_clip_and_step,
    load_optimizer_checkpoint,
    save_optimizer_checkpoint,
    train_global_batches,
)
from relayrl.models.policy import logprobs as lp_ops
from relayrl.utils import device as dev
from relayrl.utils.paths import resolve_model_path

FP8_E4M3_MAX = 448.0
_ATTN_PROJ = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([qkv])_proj$")
# transformers' loading patches process-wide state (meta-device init), so in-process workers load one at a time.
_LOAD_LOCK = threading.Lock()


def load_causal_lm(config: PolicyConfig, weights_path: str | None = None) -> PreTrainedModel:
    """The policy network in float32: `weights_path` if given, else `model_name` (fresh weights if random_init)."""
    with _LOAD_LOCK:
        return _load_causal_lm(config, weights_path)


def _load_causal_lm(config: PolicyConfig, weights_path: str | None) -> PreTrainedModel:
    source = resolve_model_path(weights_path or config.model_name)  # clear FileNotFound / not-a-model errors
    try:
        hf_config = AutoConfig.from_pretrained(source)
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"cannot read a model config from {source}: {exc}") from exc
    for key, value in config.hf_config_overrides.items():
        if not hasattr(hf_config, key):
            raise ValueError(f"policy.hf_config_overrides: {type(hf_config).__name__} has no attribute {key!r}")
        setattr(hf_config, key, value)
    try:
        if config.random_init and weights_path is None:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, config=hf_config, dtype=torch.float32)
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"cannot load a causal language model from {source}: {exc}") from exc
    if model.get_output_embeddings() is None:
        raise ValueError(f"model at {source} has no output embeddings (lm_head); a causal LM is required")
    return model.float()


def _move(module: nn.Module, device: torch.device) -> None:
    """Move a module's parameters and buffers in place (a no-op when they are already there).

    Checked first because `Module.to` walks every tensor even when nothing moves, which costs milliseconds a pass.
    """
    if all(t.device == device for t in itertools.chain(module.parameters(), module.buffers())):
        return
    module.to(device)


def _set_mode(module: nn.Module, training: bool) -> None:
    """`module.train(training)` only when the mode changes (the recursive walk is not free on every pass)."""
    if module.training != training:
        module.train(training)


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


def percentile_of(values: list[float], percentile: float) -> float:
    """Nearest-rank percentile: sorted values indexed at round(p/100 * (n-1)); 0.0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(max(round(percentile / 100.0 * (len(ordered) - 1)), 0), len(ordered) - 1)
    return ordered[idx]


class PolicyWorker:
    """Holds one replica and runs logprob, top-k, train and calibration passes on its data shard."""

    def __init__(
        self,
        config: PolicyConfig,
        tokenizer: Any = None,
        *,
        rank: int = 0,
        comm: Collective | None = None,
        device: str = "auto",
        init_reference_model: bool = True,
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
        self.model = load_causal_lm(config, weights_path)
        if self.comm.world_size > 1:  # every replica starts from rank 0's weights (matters for random_init)
            for tensor in self.model.state_dict().values():
                self.comm.broadcast(tensor, src=0)
        if config.activation_checkpointing and self.model.supports_gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _move(self.model, self.device)
        self.weights_version = 0
        # Snapshot of the loaded weights (a checkpoint's on resume, as in the reference system), taken before any
        # data-parallel wrapping. A second frozen module on the CPU costs the same memory as a state-dict snapshot
        # but needs no weight swapping: on CPU it is used in place, on a GPU it is moved over only for the reference.
        self.reference_model: PreTrainedModel | None = None
        if init_reference_model:
            self.reference_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            _move(self.reference_model, torch.device("cpu"))
        # `self.model` stays the plain full module every other pass reads; training runs on `self.dp.train_module`.
        self.dp = wrap_model(self.model, config.data_parallel.strategy, self.comm, self.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if init_optimizer:
            self._build_optimizer(max_num_steps)
        if optimizer_path is not None:
            self._load_optimizer(optimizer_path)

    # ------------------------------------------------------------------ construction helpers
    def _build_optimizer(self, max_num_steps: int | None) -> None:
        kw = self.cfg.optimizer.kwargs
        params = self.dp.params
        self.optimizer = torch.optim.AdamW(
            params, lr=kw.lr, weight_decay=kw.weight_decay, betas=kw.betas, eps=kw.eps, **dev.adamw_kernel(params)
        )
        sched = self.cfg.scheduler
        lr_factor(sched.warmup_steps, sched, max_num_steps)  # fail now, not at step N, if cosine has no horizon
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, sched, max_num_steps))

    def _load_optimizer(self, optimizer_path: str) -> None:
        self.weights_version = load_optimizer_checkpoint(
            optimizer_path, self.optimizer, self.scheduler, self.dp, self.device, "policy"
        )

    # ------------------------------------------------------------------ forward building blocks
    @property
    def temperature(self) -> float:
        return self.cfg.generation.temperature

    def _lm_head(self, model: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor]:
        head = model.get_output_embeddings()
        cap = getattr(model.config, "final_logit_softcapping", None)
        if not cap:
            return head
        return lambda h: torch.tanh(head(h) / cap) * cap

    def _chunk_size(self, rows: int, model: PreTrainedModel) -> int:
        vocab = model.get_output_embeddings().weight.shape[0]
        return self.cfg.logprob_chunk_size or lp_ops.auto_chunk_size(rows, vocab)

    def _hidden(self, model: PreTrainedModel, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, S, H] of the backbone; attention limited to each row's real tokens.

        Llama-family models take the packed fast path (positions at or past a row's length come back as zeros);
        others, and models with hooks (FP8 calibration), go through HF's forward.
        """
        return backbone_hidden_states(model, input_ids, input_lengths, native=self.cfg.native_cpu_ops)

    def _next_token_logprobs(
        self,
        model: PreTrainedModel,
        mb: BatchedDataDict,
        select: torch.Tensor,
        *,
        filtered: bool,
        return_unfiltered: bool = False,
        fill: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Temperature-scaled (and, if `filtered`, top-k/top-p filtered) next-token log-probs [B, S-1].

        Only the positions where `select` [B, S-1] is True are computed, and only the work they depend on (each row
        cut after its last selected position, shared prompt prefixes computed once, the last layer's MLP and the head
        at selected positions only; see `packing.SharedPacking`). Other positions hold `fill` [B, S-1] (zeros if None).
        """
        gen = self.cfg.generation
        input_ids, lengths = mb["input_ids"], mb["input_lengths"]  # [B, S], [B]
        batch, seq = input_ids.shape
        positions = torch.arange(seq - 1, device=input_ids.device)  # [S-1]
        select = select.to(input_ids.device).bool() & (positions[None, :] < lengths.to(input_ids.device)[:, None] - 1)
        rows_per_chunk = self.cfg.logprob_chunk_size * batch if self.cfg.logprob_chunk_size else None
        with dev.autocast(self.device, self.cfg.precision):
            hidden = selected_hidden_states(
                model, input_ids, lengths, F.pad(select, (0, 1)), native=self.cfg.native_cpu_ops
            )  # [M, H]
            lp, plain = lp_ops.selected_logprobs(
                hidden,
                self._lm_head(model),
                input_ids[:, 1:][select],  # [M] targets
                temperature=self.temperature,
                top_k=gen.top_k if filtered else None,
                top_p=gen.top_p if filtered else 1.0,
                chunk_size=rows_per_chunk,
                return_unfiltered=return_unfiltered,
            )  # [M]
        base = torch.zeros(batch, seq - 1) if fill is None else fill.float()  # [B, S-1]
        base = base.to(lp.device)
        full = base.masked_scatter(select.to(lp.device), lp)  # [B, S-1]
        return full, (None if plain is None else base.masked_scatter(select.to(lp.device), plain))

    @property
    def filtering(self) -> bool:
        return lp_ops.filtering_active(self.cfg.generation.top_k, self.cfg.generation.top_p)

    def _model_device(self, model: nn.Module) -> torch.device:
        return next(model.parameters()).device

    def _micro_batches(self, data: BatchedDataDict, size: int, device: torch.device) -> Iterator[BatchedDataDict]:
        n = data.size
        for start in range(0, n, size):
            yield data.slice(start, min(start + size, n)).to(device)

    @contextlib.contextmanager
    def _mode(self, model: nn.Module, training: bool) -> Iterator[None]:
        """Switch train/eval mode for one pass and restore the caller's mode afterwards."""
        previous = model.training
        _set_mode(model, training)
        try:
            yield
        finally:
            _set_mode(model, previous)

    # ------------------------------------------------------------------ logprob-style passes
    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        return BatchedDataDict(logprobs=self._logprobs(self.model, data, micro_batch_size, filtered=self.filtering))

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        if self.reference_model is None:
            raise RuntimeError("reference log-probs requested but the policy was built with init_reference_model=False")
        ref = self.reference_model
        _move(ref, self.device)
        try:  # temperature kept, top-k/top-p off: the KL term compares full distributions
            out = self._logprobs(ref, data, micro_batch_size, filtered=False)
        finally:
            _move(ref, torch.device("cpu"))
            dev.empty_cache(self.device)
        return BatchedDataDict(reference_logprobs=out)

    def _logprobs(
        self, model: PreTrainedModel, data: BatchedDataDict, mbs: int | None, *, filtered: bool
    ) -> torch.Tensor:
        mbs = mbs or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        device = self._model_device(model)
        outs = [torch.zeros(0, data["input_ids"].shape[1])]
        with self._mode(model, False), torch.no_grad():
            for mb in self._micro_batches(data, mbs, device):
                keep = torch.ones_like(mb["input_ids"][:, 1:], dtype=torch.bool)  # [b, S-1]
                if filtered:  # only loss positions are kept (the rest would be zeroed)
                    if "token_mask" in mb:
                        keep &= mb["token_mask"][:, 1:].bool()
                    if "sample_mask" in mb:
                        keep &= mb["sample_mask"].bool()[:, None]
                lp, _ = self._next_token_logprobs(model, mb, keep, filtered=filtered)  # [b, S-1]
                if filtered:  # -inf (sampled token outside the kept set) -> 0
                    lp = lp_ops.zero_invalid(lp, keep)
                outs.append(lp_ops.token_aligned(lp, mb["input_lengths"]).float().cpu())  # [b, S]
        return torch.cat(outs)  # [B, S]

    def get_topk_logits(self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None) -> BatchedDataDict:
        mbs = micro_batch_size or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        seq = data["input_ids"].shape[1]
        values, indices = [torch.zeros(0, max(seq - 1, 0), k)], [torch.zeros(0, max(seq - 1, 0), k, dtype=torch.long)]
        with self._mode(self.model, False), torch.no_grad():
            for mb in self._micro_batches(data, mbs, self._model_device(self.model)):
                with dev.autocast(self.device, self.cfg.precision):
                    hidden = self._hidden(self.model, mb["input_ids"], mb["input_lengths"])  # [b, S, H]
                    v, i = lp_ops.topk_logits(
                        hidden,
                        self._lm_head(self.model),
                        k,
                        temperature=self.temperature,
                        chunk_size=self._chunk_size(hidden.shape[0], self.model),
                    )  # [b, S-1, k]
                # Position t predicts token t+1; it is padding once t+1 reaches the row's length.
                pad = torch.arange(seq - 1, device=v.device)[None, :] >= (mb["input_lengths"].to(v.device) - 1)[:, None]
                values.append(v.masked_fill(pad[..., None], 0.0).float().cpu())
                indices.append(i.masked_fill(pad[..., None], 0).long().cpu())
        return BatchedDataDict(topk_logits=torch.cat(values), topk_indices=torch.cat(indices))

    # ------------------------------------------------------------------ training
    def train(
        self, data: BatchedDataDict, loss_fn: Callable[..., Any], eval_mode: bool, gbs: int, mbs: int
    ) -> dict[str, Any]:
        """§3.9: one optimizer step per global batch of `gbs` rows (this rank holds gbs / world of them)."""
        if not eval_mode and (self.optimizer is None or self.scheduler is None):
            raise RuntimeError("train() needs an optimizer but the policy was built with init_optimizer=False")
        device = self._model_device(self.model)
        grad_ctx = torch.no_grad() if eval_mode else contextlib.nullcontext()
        with self._mode(self.model, not eval_mode), grad_ctx:
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
                valid_tokens=lambda gb_data: gb_data["token_mask"][:, 1:],
                loss_for_microbatch=self._policy_microbatch_loss(loss_fn),
                step=self._reduce_clip_and_step,
                rank=self.rank,
                dp=self.dp,
                zero_loss=self._zero_loss,
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

    def _policy_microbatch_loss(
        self, loss_fn: Callable[..., Any]
    ) -> Callable[[BatchedDataDict, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]:
        """Current-policy next-token logprobs (filtered like the sampler, plus an unfiltered copy for the KL term when
        filtering is on) fed to `loss_fn` with the global counts."""

        def microbatch_loss(
            mb: BatchedDataDict, global_seqs: torch.Tensor, global_toks: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            keep = mb["token_mask"][:, 1:].bool() & mb["sample_mask"].bool()[:, None]  # [b, S-1] loss positions
            # Only loss positions are computed; the others (multiplied by a zero mask in every loss) hold the
            # previous policy's log-probs, so ratios there stay finite (1) instead of exp(-prev) overflowing.
            fill = mb["prev_logprobs"][:, 1:] if "prev_logprobs" in mb else None
            lp, plain = self._next_token_logprobs(
                self.dp.train_module, mb, keep, filtered=self.filtering, return_unfiltered=self.filtering, fill=fill
            )  # [b, S-1]
            if self.filtering:
                lp = lp_ops.zero_invalid(lp, keep)
                mb["curr_logprobs_unfiltered"] = plain
            return loss_fn(lp, mb, global_seqs, global_toks)

        return microbatch_loss

    def _zero_loss(self, mb: BatchedDataDict) -> torch.Tensor:
        """0 x the logits of a full HF forward of the training module: touches every parameter, so a DDP/FSDP2 rank
        with nothing to learn from a micro-batch still joins its peers' gradient collectives (zero gradients)."""
        ids = mb["input_ids"]  # [b, S]
        lengths = mb["input_lengths"].to(ids.device).clamp(min=1)  # [b]
        mask = (torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]).long()  # [b, S]
        logits = self.dp.train_module(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [b, S, V]
        return logits.float().sum() * 0.0

    def _reduce_clip_and_step(self, params: list[nn.Parameter]) -> torch.Tensor:
        """Sum gradients over ranks, clip to max_grad_norm, step; returns the pre-clip global L2 norm."""
        assert self.optimizer is not None
        grad_norm = all_reduce_clip_and_step(params, self.comm, self.optimizer, self.cfg.max_grad_norm, self.dp)
        self.weights_version += 1
        return grad_norm

    # ------------------------------------------------------------------ FP8 KV-cache calibration
    def calibrate_qkv_fp8_scales(
        self, data: BatchedDataDict, micro_batch_size: int | None, percentile: float, margin: float, include_q: bool
    ) -> dict[str, Any]:
        """Per-layer FP8 scales from the percentile of per-micro-batch |q|/|k|/|v| maxima over real tokens."""
        wanted = ("q", "k", "v") if include_q else ("k", "v")
        samples: dict[tuple[int, str], list[float]] = defaultdict(list)
        token_mask: dict[str, torch.Tensor] = {}
        hooks = []

        def make_hook(layer: int, which: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
                per_token = output.detach().abs().amax(dim=-1).float()  # [b, S]
                samples[(layer, which)].append(float(per_token.masked_fill(~token_mask["m"], 0.0).max()))

            return hook

        for name, module in self.model.named_modules():
            match = _ATTN_PROJ.search(name)
            if match and match.group(2) in wanted:
                hooks.append(module.register_forward_hook(make_hook(int(match.group(1)), match.group(2))))
        if not hooks:
            raise ValueError(f"{type(self.model).__name__} has no layers.N.self_attn.{{q,k,v}}_proj modules")
        mbs = micro_batch_size or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        try:
            with self._mode(self.model, False), torch.no_grad():
                for mb in self._micro_batches(data, mbs, self._model_device(self.model)):
                    seq = mb["input_ids"].shape[1]
                    token_mask["m"] = (
                        torch.arange(seq, device=mb["input_ids"].device)[None] < mb["input_lengths"][:, None]
                    )
                    with dev.autocast(self.device, self.cfg.precision):
                        self._hidden(self.model, mb["input_ids"], mb["input_lengths"])
        finally:
            for h in hooks:
                h.remove()
        amax = {key: percentile_of(vals, percentile) for key, vals in samples.items()}
        merged: dict[tuple[int, str], float] = {}
        for rank_amax in self.comm.all_gather_object(amax):  # elementwise max over data-parallel ranks
            for key, value in rank_amax.items():
                merged[key] = max(merged.get(key, 0.0), value)
        layers = {
            f"model.layers.{layer}.self_attn.{which}_scale": value * margin / FP8_E4M3_MAX
            for (layer, which), value in sorted(merged.items())
        }
        return {"format": "fp8", "percentile": percentile, "margin": margin, "layers": layers}

    # ------------------------------------------------------------------ memory phases
    def prepare_for_training(self) -> None:
        _move(self.model, self.device)
        _set_mode(self.model, True)
        if self.optimizer is not None:
            dev.move_optimizer_state(self.optimizer, self.device)
        dev.empty_cache(self.device)

    def prepare_for_lp_inference(self) -> None:
        _move(self.model, self.device)
        _set_mode(self.model, False)
        dev.empty_cache(self.device)

    def finish_training(self) -> None:
        _set_mode(self.model, False)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def offload_before_refit(self) -> None:
        if self.optimizer is not None:
            dev.move_optimizer_state(self.optimizer, torch.device("cpu"))
        dev.empty_cache(self.device)

    def offload_after_refit(self) -> None:
        _move(self.model, torch.device("cpu"))
        self.model.eval()
        self.offload_before_refit()

    # ------------------------------------------------------------------ weights in / out
    def get_weights_version(self) -> int:
        return self.weights_version

    def get_device(self) -> str:
        return str(self.device)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Copy saved weights into the live module in place (its identity, shared with a colocated engine, stays)."""
        saved = load_causal_lm(self.cfg, weights_path)
        self.model.load_state_dict(saved.state_dict())
        self.dp.load_full_into_shards()
        if optimizer_path is not None:
            self._load_optimizer(optimizer_path)  # also restores weights_version
        else:
            self.weights_version += 1  # the live weights changed: a colocated engine must notice

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def prepare_refit_info(self) -> dict[str, Any]:
        dtype = dev.precision_dtype(self.cfg.precision)  # streamed tensors are cast to the policy precision
        return {name: (tuple(t.shape), dtype) for name, t in self.model.state_dict().items()}

    # ------------------------------------------------------------------ refit to separate generation workers
    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int, kv_scales: dict[str, float] | None = None) -> bool:
        """Stream this rank's weights (policy precision) to the generation worker on the same device."""
        if kv_scales is not None:
            raise ValueError("stream_weights_via_ipc_zmq: kv_scales must be None (send them with the collective refit)")
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        address = refit.ipc_address(refit.device_ipc_tag(self.device, local_rank))
        dtype = dev.precision_dtype(self.cfg.precision)
        refit.stream_weights_via_ipc_zmq(self.model.state_dict().items(), address, buffer_size_bytes, dtype=dtype)
        return True

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> bool:
        """Join the weight-update group: training ranks 0..train_world_size-1, generation workers after them."""
        if not 0 <= self.rank < train_world_size < world_size:
            raise ValueError(
                f"init_collective: training rank {self.rank} needs 0 <= rank < train_world_size={train_world_size} "
                f"< world_size={world_size}"
            )
        self._weight_group = refit.WeightUpdateGroup(ip, port, self.rank, world_size)
        return True

    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> bool:
        """Rank 0 broadcasts its weights (and KV scales); the other training ranks take part and drop them."""
        group = getattr(self, "_weight_group", None)
        if group is None:
            raise RuntimeError("broadcast_weights_for_collective: call init_collective first")
        if self.rank == 0:
            dtype = dev.precision_dtype(self.cfg.precision)
            group.send_weights(self.model.state_dict().items(), dtype=dtype, kv_scales=kv_scales)
        else:  # a data-parallel replica already holds these weights
            group.receive_weights(self.prepare_refit_info(), None)
        return True

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """HF directory (config + safetensors) at weights_path; optimizer/scheduler state at optimizer_path.

        Called on every rank (gathering fsdp2's sharded optimizer state is a collective); rank 0 writes."""
        if optimizer_path is not None:
            save_optimizer_checkpoint(
                optimizer_path, self.optimizer, self.scheduler, self.weights_version, self.dp, self.rank, "policy"
            )
        if self.rank != 0:
            return
        self.model.save_pretrained(weights_path)
        if tokenizer_path is not None:
            if self.tokenizer is None:
                raise ValueError("tokenizer_path was given but the policy has no tokenizer")
            self.tokenizer.save_pretrained(tokenizer_path)

    def shutdown(self) -> bool:
        self.reference_model = None
        self.optimizer = None
        self.scheduler = None
        return True

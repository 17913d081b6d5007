"""PolicyWorker: one data-parallel replica of the policy and its policy-specific compute.

The shared replica mechanics (loading, optimizer and LR schedule, train(), memory phases, checkpoints) live in
`models.worker_base.ModelWorker`. Here: the frozen reference copy, next-token log-probs (filtered like the sampler),
top-k logits, the policy loss of a micro-batch, FP8 KV-cache calibration and the refit senders. Everything that
must agree across data-parallel ranks (calibration maxima included) goes through `self.comm`.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Unpack

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from relayrl.algorithms.interfaces import LossFunction
from relayrl.config import PolicyConfig
from relayrl.data_plane.schema import GENERATION_SUPPORT
from relayrl.distributed import refit, refit_digest
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models import fp8_kv
from relayrl.models.fast.forward import backbone_hidden_states, hf_hidden_states, selected_hidden_states
from relayrl.models.microbatch import pass_batches, place
from relayrl.models.policy import logprobs as lp_ops
from relayrl.models.policy import lora, reference
from relayrl.models.worker_base import (
    LOAD_LOCK,
    MicrobatchLoss,
    ModelWorker,
    WorkerOptions,
    move_module,
    read_hf_config,
)
from relayrl.utils import device as dev
from relayrl.utils.paths import resolve_model_path


def load_causal_lm(config: PolicyConfig, weights_path: str | None = None) -> PreTrainedModel:
    """The policy network in float32: `weights_path` if given, else `model_name` (fresh weights if random_init)."""
    with LOAD_LOCK:
        return _load_causal_lm(config, weights_path)


def _load_causal_lm(config: PolicyConfig, weights_path: str | None) -> PreTrainedModel:
    source = resolve_model_path(weights_path or config.model_name)  # clear FileNotFound / not-a-model errors
    hf_config = read_hf_config(source, config.hf_config_overrides, "policy")
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


def percentile_of(values: list[float], percentile: float) -> float:
    """Nearest-rank percentile: sorted values indexed at round(p/100 * (n-1)); 0.0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(max(round(percentile / 100.0 * (len(ordered) - 1)), 0), len(ordered) - 1)
    return ordered[idx]


class PolicyWorker(ModelWorker):
    """Holds one replica and runs logprob, top-k, train and calibration passes on its data shard."""

    owner = "policy"
    fused_adamw = True
    cfg: PolicyConfig
    model: PreTrainedModel

    def __init__(
        self,
        config: PolicyConfig,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        init_reference_model: bool = True,
        **options: Unpack[WorkerOptions],
    ) -> None:
        self._init_reference_model = init_reference_model
        self.reference_model: PreTrainedModel | None = None
        self._weight_group: refit.TrainerRefit | None = None  # joined by init_collective
        self.peft_model: Any = None  # policy.lora: the peft wrapper of `self.model` (adapters injected in place)
        self._merged_source: lora.MergedGenerationSource | None = None
        super().__init__(config, tokenizer, **options)

    def _load(self, weights_path: str | None) -> PreTrainedModel:
        if not self.cfg.lora.enabled:
            return load_causal_lm(self.cfg, weights_path)
        adapters = weights_path is not None and lora.is_adapter_dir(weights_path)  # a LoRA run's checkpoint
        model = load_causal_lm(self.cfg, None if adapters else weights_path)
        self.peft_model = lora.add_adapters(model, self.cfg)
        if adapters:
            lora.load_adapters(self.peft_model, str(weights_path))
        return model

    def _backbone(self) -> PreTrainedModel:
        return self.model

    def _save_weights(self, path: str) -> None:
        if self.peft_model is not None:  # the adapters alone: the base weights never change
            lora.save_adapters(self.peft_model, path)
        else:
            self.model.save_pretrained(path)

    def _load_weights_in_place(self, weights_path: str) -> None:
        if self.peft_model is None:
            return super()._load_weights_in_place(weights_path)
        if not lora.is_adapter_dir(weights_path):
            raise ValueError(
                f"{weights_path} holds full weights, not LoRA adapters: it was written with policy.lora.enabled=false; "
                "resume it with policy.lora.enabled=false or start a new run directory"
            )
        lora.load_adapters(self.peft_model, weights_path)

    @property
    def generation_view(self) -> Any:
        """What a colocated engine reads (`.model`, `.weights_version`): this worker, or under LoRA a plain module
        holding the merged weights (re-merged when the weights move)."""
        if self.peft_model is None:
            return self
        if self._merged_source is None:
            self._merged_source = lora.MergedGenerationSource(self, lambda: load_causal_lm(self.cfg))
        return self._merged_source

    def _generation_tensors(self, merge: bool = True) -> Any:
        """(name, tensor) pairs of the weights generation runs on: the live state dict, or the merged LoRA weights
        under the base model's names."""
        if self.peft_model is None:
            return self.model.state_dict().items()
        return lora.merged_named_tensors(self.model, merge=merge)

    def generation_storage(self) -> set[int]:
        """Data pointers of the tensors generation reads from this worker unchanged (all of them; under LoRA the
        ones no adapter touches): an in-process engine reading them in place has nothing to verify there."""
        return {t.data_ptr() for _, t in self._generation_tensors(merge=False)}

    def refit_digests(self, keys: list[str]) -> refit_digest.Digests:
        """The trainer's side of refit verification: digests of the weights generation must hold (merged under
        LoRA), under a generation engine's keys, computed where they live."""
        return refit_digest.expected_digests(self._generation_tensors(), keys)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights generation runs on (live tensors; under LoRA the merged ones, under the base model's names)."""
        return dict(self._generation_tensors())

    def _before_wrap(self) -> None:
        """Snapshot the loaded weights (a checkpoint's on resume, as in the reference system) before any
        data-parallel wrapping: a second frozen module, resident on the device (`policy.reference.offload`: parked
        on the CPU, moved over for each reference pass), its projections in the compute precision (`reference`).
        Under LoRA the reference is the live module with its adapters off: nothing to copy.
        """
        if self._init_reference_model and self.peft_model is None:
            dtype = dev.precision_dtype(self.cfg.precision)
            ref = reference.build_reference(self.model, dtype, self.device, offload=self.cfg.reference.offload)
            self.reference_model = ref

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

    @staticmethod
    def _vocab(model: PreTrainedModel) -> int:
        return int(model.get_output_embeddings().weight.shape[0])

    def _chunk_size(self, rows: int, model: PreTrainedModel) -> int:
        return self.cfg.logprob_chunk_size or lp_ops.auto_chunk_size(
            rows, self._vocab(model), lp_ops.chunk_budget_bytes(self.device)
        )

    def _hidden(
        self, model: PreTrainedModel, input_ids: torch.Tensor, input_lengths: torch.Tensor, packed: bool = False
    ) -> torch.Tensor:
        """Final hidden states [B, S, H] of the backbone; attention limited to each row's real tokens (`packed`: each
        sequence's own, over the rows as one packed stream).

        Llama-family models take the packed fast path (positions at or past a row's length come back as zeros);
        others, and models with hooks, go through HF's forward.
        """
        native = self.cfg.native_cpu_ops
        return backbone_hidden_states(model, input_ids, input_lengths, native=native, packed=packed)

    def _next_token_logprobs(
        self,
        model: PreTrainedModel,
        mb: BatchedDataDict,
        select: torch.Tensor,
        *,
        filtered: bool,
        return_unfiltered: bool = False,
        fill: torch.Tensor | None = None,
        mismatch_out: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Temperature-scaled (and, if `filtered`, top-k/top-p filtered) next-token log-probs [B, S-1].

        Filtered passes apply the sampler's recorded kept set where the batch carries one (`generation_support`
        [B, S, K], token-aligned), else the filter recomputed from these logits; `mismatch_out` receives the
        support-mismatch flags of the selected positions (`logprobs.selected_logprobs`).

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
        packed = self.cfg.sequence_packing.enabled
        support = mb.get(GENERATION_SUPPORT) if filtered else None
        if support is not None:
            support = support[:, 1:].to(select.device)[select]  # [M, K]: the set each selected target came from
        if packed and rows_per_chunk is None and not torch.is_grad_enabled():  # no-grad packed micro-batches hold
            # many rows: small head slabs (training keeps the default, where more chunks would mean recomputation)
            rows_per_chunk = lp_ops.auto_chunk_size(1, self._vocab(model), lp_ops.chunk_budget_bytes(self.device, True))
        with dev.autocast(self.device, self.cfg.precision):
            hidden = selected_hidden_states(
                model,
                input_ids,
                lengths,
                F.pad(select, (0, 1)),
                native=self.cfg.native_cpu_ops,
                packed=packed,
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
                support=support,
                mismatch_out=mismatch_out,
            )  # [M]
        base = torch.zeros(batch, seq - 1, device=lp.device) if fill is None else fill.float().to(lp.device)  # [B, S-1]
        full = base.masked_scatter(select.to(lp.device), lp)  # [B, S-1]
        return full, (None if plain is None else base.masked_scatter(select.to(lp.device), plain))

    @property
    def filtering(self) -> bool:
        return lp_ops.filtering_active(self.cfg.generation.top_k, self.cfg.generation.top_p)

    # ------------------------------------------------------------------ logprob-style passes
    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        return BatchedDataDict(logprobs=self._logprobs(self.model, data, micro_batch_size, filtered=self.filtering))

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        if not self._init_reference_model:
            raise RuntimeError("reference log-probs requested but the policy was built with init_reference_model=False")
        if self.peft_model is not None:  # the base model: adapters off (temperature kept, no top-k/top-p)
            with lora.reference_mode(self.peft_model):
                out = self._logprobs(self.model, data, micro_batch_size, filtered=False)
            return BatchedDataDict(reference_logprobs=out)
        ref = self.reference_model
        assert ref is not None
        move_module(ref, self.device)  # a no-op unless policy.reference.offload parked it on the CPU
        try:  # temperature kept, top-k/top-p off: the KL term compares full distributions
            out = self._logprobs(ref, data, micro_batch_size, filtered=False)
        finally:
            if self.cfg.reference.offload:
                move_module(ref, torch.device("cpu"))
                dev.empty_cache(self.device, self.cfg.empty_cache_between_phases)
        return BatchedDataDict(reference_logprobs=out)

    def _logprobs(
        self, model: PreTrainedModel, data: BatchedDataDict, mbs: int | None, *, filtered: bool
    ) -> torch.Tensor:
        mbs = mbs or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        device = self._model_device(model)
        out = torch.zeros(data["input_ids"].shape)  # [B, S]
        with self._mode(model, False), torch.no_grad():
            for rows, mb in pass_batches(data, self.cfg, mbs, device):
                keep = torch.ones_like(mb["input_ids"][:, 1:], dtype=torch.bool)  # [b, S-1]
                if filtered:  # only loss positions are kept (the rest would be zeroed)
                    if "token_mask" in mb:
                        keep &= mb["token_mask"][:, 1:].bool()
                    if "sample_mask" in mb:
                        keep &= mb["sample_mask"].bool()[:, None]
                lp, _ = self._next_token_logprobs(model, mb, keep, filtered=filtered)  # [b, S-1]
                # (recorded kept sets apply here too; the training pass counts their mismatches)
                if filtered:  # -inf (sampled token outside the kept set) -> 0
                    lp = lp_ops.zero_invalid(lp, keep)
                place(out, rows, lp_ops.token_aligned(lp, mb["input_lengths"]).float().cpu())  # [b, S] or [b, w]
        return out  # [B, S]

    def get_topk_logits(self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None) -> BatchedDataDict:
        mbs = micro_batch_size or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        rows_total, seq = data["input_ids"].shape
        values = torch.zeros(rows_total, max(seq - 1, 0), k)  # [B, S-1, k]
        indices = torch.zeros(rows_total, max(seq - 1, 0), k, dtype=torch.long)  # [B, S-1, k]
        packed = self.cfg.sequence_packing.enabled
        with self._mode(self.model, False), torch.no_grad():
            for rows, mb in pass_batches(data, self.cfg, mbs, self._model_device(self.model)):
                width = mb["input_ids"].shape[1]  # S, or the micro-batch's own width under packing / dynamic batching
                with dev.autocast(self.device, self.cfg.precision):
                    hidden = self._hidden(self.model, mb["input_ids"], mb["input_lengths"], packed)  # [b, w, H]
                    v, i = lp_ops.topk_logits(
                        hidden,
                        self._lm_head(self.model),
                        k,
                        temperature=self.temperature,
                        chunk_size=self._chunk_size(hidden.shape[0], self.model),
                    )  # [b, S-1, k]
                # Position t predicts token t+1; it is padding once t+1 reaches the row's length.
                pad = (
                    torch.arange(width - 1, device=v.device)[None, :] >= (mb["input_lengths"].to(v.device) - 1)[:, None]
                )
                place(values, rows, v.masked_fill(pad[..., None], 0.0).float().cpu())
                place(indices, rows, i.masked_fill(pad[..., None], 0).long().cpu())
        return BatchedDataDict(topk_logits=values, topk_indices=indices)

    # ------------------------------------------------------------------ training (the loop is ModelWorker.train)
    def valid_tokens(self, data: BatchedDataDict) -> torch.Tensor:
        return data["token_mask"][:, 1:]  # [b, S-1]: position 0 predicts nothing

    def _microbatch_loss(self, loss_fn: LossFunction) -> MicrobatchLoss:
        """Current-policy next-token logprobs (filtered like the sampler, plus an unfiltered copy for the KL term when
        filtering is on) fed to `loss_fn` with the global counts."""

        def microbatch_loss(
            mb: BatchedDataDict, global_seqs: torch.Tensor, global_toks: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            keep = mb["token_mask"][:, 1:].bool() & mb["sample_mask"].bool()[:, None]  # [b, S-1] loss positions
            # Only loss positions are computed; the others (multiplied by a zero mask in every loss) hold the
            # previous policy's log-probs, so ratios there stay finite (1) instead of exp(-prev) overflowing.
            fill = mb["prev_logprobs"][:, 1:] if "prev_logprobs" in mb else None
            mismatch: list[torch.Tensor] = []
            lp, plain = self._next_token_logprobs(
                self.dp.train_module,
                mb,
                keep,
                filtered=self.filtering,
                return_unfiltered=self.filtering,
                fill=fill,
                mismatch_out=mismatch,
            )  # [b, S-1]
            if self.filtering:
                lp = lp_ops.zero_invalid(lp, keep)
                mb["curr_logprobs_unfiltered"] = plain
            loss, metrics = loss_fn(lp, mb, global_seqs, global_toks)
            if self.filtering and GENERATION_SUPPORT in mb:
                metrics.update(lp_ops.support_metrics(mismatch, mb[GENERATION_SUPPORT][:, 1:], keep, global_toks))
            return loss, metrics

        return microbatch_loss

    def zero_loss(self, mb: BatchedDataDict) -> torch.Tensor:
        """0 x the logits of a full HF forward of the training module: touches every parameter, so a DDP/FSDP2 rank
        with nothing to learn from a micro-batch still joins its peers' gradient collectives (zero gradients)."""
        ids = mb["input_ids"]  # [b, S]
        lengths = mb["input_lengths"].to(ids.device).clamp(min=1)  # [b]
        mask = (torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]).long()  # [b, S]
        logits = self.dp.train_module(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [b, S, V]
        return logits.float().sum() * 0.0

    # ------------------------------------------------------------------ FP8 KV-cache calibration
    def calibrate_qkv_fp8_scales(
        self, data: BatchedDataDict, micro_batch_size: int | None, percentile: float, margin: float, include_q: bool
    ) -> dict[str, Any]:
        """Per-layer FP8 scales of the attention inputs, as the reference (NeMo RL) computes them.

        Every attention call of HF's forward shows its q, k, v (after the q/k norms and RoPE: what the KV cache
        holds) to an observer, which keeps max |t| over the micro-batch's real tokens (padding positions are not
        attention inputs of any real token and are left out). Per layer and tensor: the nearest-rank `percentile`
        of those per-call maxima, the elementwise max over data-parallel ranks, times margin / FP8 max (448, or
        env FP8_MAX_Q/K/V). Returns {"format": "fp8", "percentile", "margin", "layers": {name: scale}} with the
        names of `fp8_kv.scale_name`.
        """
        wanted = ("q", "k", "v") if include_q else ("k", "v")
        samples: dict[tuple[int, str], list[float]] = defaultdict(list)
        real: dict[str, torch.Tensor] = {}

        def observe(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            layer = int(getattr(module, "layer_idx"))  # noqa: B009 - HF attention modules carry it
            for which, tensor in zip("qkv", (q, k, v)):
                if which in wanted:
                    samples[(layer, which)].append(fp8_kv.masked_amax(tensor, real["m"]))

        mbs = micro_batch_size or self.cfg.logprob_batch_size or self.cfg.train_micro_batch_size
        device = self._model_device(self.model)
        with fp8_kv.observe_attention_inputs(self.model, observe), self._mode(self.model, False), torch.no_grad():
            for mb in self.micro_batches(data, mbs, device):
                ids, lengths = mb["input_ids"], mb["input_lengths"].to(device)
                real["m"] = torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]  # [b, S]
                with dev.autocast(self.device, self.cfg.precision):
                    hf_hidden_states(self.model, ids, lengths)  # HF's forward: its attention calls are observed
        if not samples and len(data["input_ids"]):
            raise ValueError(f"{type(self.model).__name__}: no attention call was observed during calibration")
        amax = {key: percentile_of(vals, percentile) for key, vals in samples.items()}
        merged: dict[tuple[int, str], float] = {}
        for rank_amax in self.comm.all_gather_object(amax):  # elementwise max over data-parallel ranks
            for key, value in rank_amax.items():
                merged[key] = max(merged.get(key, 0.0), value)
        layers = {
            fp8_kv.scale_name(layer, which): value * margin / fp8_kv.fp8_max(which)
            for (layer, which), value in sorted(merged.items())
        }
        return {"format": "fp8", "percentile": percentile, "margin": margin, "layers": layers}

    # ------------------------------------------------------------------ memory phases (plus ModelWorker's)
    def prepare_for_lp_inference(self) -> None:
        self._enter_inference(offload_optimizer=False)

    def offload_before_refit(self) -> None:
        self.offload_optimizer()

    def offload_after_refit(self) -> None:
        self.offload_to_cpu()

    # ------------------------------------------------------------------ refit to separate generation workers
    def prepare_refit_info(self) -> refit.RefitInfo:
        dtype = dev.precision_dtype(self.cfg.precision)  # streamed tensors are cast to the policy precision
        return refit.refit_info(self._generation_tensors(merge=False), dtype)  # tied tensors marked: sent once

    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int, kv_scales: dict[str, float] | None = None) -> bool:
        """Stream this rank's weights (policy precision) to the generation worker on the same device."""
        if kv_scales is not None:
            raise ValueError("stream_weights_via_ipc_zmq: kv_scales must be None (send them with the collective refit)")
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        address = refit.ipc_address(refit.device_ipc_tag(self.device, local_rank))
        dtype = dev.precision_dtype(self.cfg.precision)
        refit.stream_weights_via_ipc_zmq(self._generation_tensors(), address, buffer_size_bytes, dtype=dtype)
        return True

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> bool:
        """Join the weight-update group: rank 0 as its source; other ranks hold the same weights and stay out."""
        self._weight_group = refit.TrainerRefit(ip, port, world_size, train_world_size=train_world_size, rank=self.rank)
        return True

    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> bool:
        """Rank 0 broadcasts its weights (and KV scales) to the generation workers; other ranks do nothing."""
        if self._weight_group is None:
            raise RuntimeError("broadcast_weights_for_collective: call init_collective first")
        dtype = dev.precision_dtype(self.cfg.precision)
        self._weight_group.broadcast(self._generation_tensors(), dtype=dtype, kv_scales=kv_scales)
        return True

    def shutdown(self) -> bool:
        self.reference_model = None
        self._merged_source = None
        return super().shutdown()

"""GenerationWorker: one generation replica with its own copy of the policy network, kept current by refit.

On the Ray executor the policy's weights live in other processes, so generation cannot read them in place as the
local colocated engine does. Each worker loads the network from the policy config once, runs an `HfGeneration`
over it, and receives the trained weights after every optimizer step, by one of two transports:

* colocated: from the training rank with the same local rank on the same node (the executor places the worker
  there and names the node in RELAYRL_NODE_ID), over ZMQ IPC (`update_weights_via_ipc_zmq`);
* not colocated: as rank `1 + i` of a weight-update group whose rank 0 is the first training rank, the only
  sender (`init_collective`, then `update_weights_from_collective`).

Received tensors are copied into the worker's module in place; the engine reads that module directly (no second
copy), and its `weights_version` is set by the driver after each refit so a stale engine refuses to generate.
FP8 KV-cache scales (`kv_cache_dtype=fp8`) arrive with the collective broadcast (`receive_weights` returns them);
the ZMQ IPC stream carries weights only, so a colocated driver sends them with `set_kv_scales`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from relayrl.config import ColocatedConfig, PolicyConfig
from relayrl.distributed import refit, refit_digest
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.interfaces import Collective
from relayrl.utils import device as dev


class _WorkerSource:
    """What the engine reads: this worker's module and the policy weights_version it last received."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weights_version = 0


class GenerationWorker:
    """Hosts one generation replica; built by `build_worker_group(GenerationWorker, cluster, ...)`."""

    def __init__(
        self,
        policy_config: PolicyConfig,
        tokenizer: Any,
        *,
        rank: int = 0,
        comm: Collective | None = None,
        device: str = "auto",
        max_total_sequence_length: int | None = None,
        seed: int = 0,
    ) -> None:
        # The engine and the model loader (transformers' modelling stack) are imported here, in the process that
        # generates: the driver and the Ray rollout actor only call this class's methods by reference, and importing
        # them there cost every such process the stack's start-up for nothing.
        from relayrl.models.generation.hf_generation import HfGeneration
        from relayrl.models.policy.worker import load_causal_lm
        from relayrl.models.worker_base import move_module

        self.rank = rank
        self.comm = comm  # generation workers never talk to each other; kept for the WorkerGroup contract
        self.device = dev.select_device(device, local_rank=int(os.environ.get("LOCAL_RANK", rank)))
        model = load_causal_lm(policy_config)
        move_module(model, self.device)
        model.requires_grad_(False).eval()
        self._source = _WorkerSource(model)
        # The engine reads this worker's module in place (the "colocated" engine mode): refit writes into it.
        gen_cfg = policy_config.generation.model_copy(update={"colocated": ColocatedConfig(enabled=True)})
        self.engine = HfGeneration(
            gen_cfg,
            tokenizer,
            self._source,
            max_total_sequence_length=max_total_sequence_length,
            seed=seed,
            precision=policy_config.precision,
        )
        delivered = dev.precision_dtype(policy_config.precision)  # what every refit sends (the policy precision)
        self._delivered = delivered if delivered != next(model.parameters()).dtype else None
        self._refit_info: refit.RefitInfo | None = None
        self._weight_group: refit.WeightUpdateGroup | None = None

    # ------------------------------------------------------------------ generation
    def generate(
        self, data: BatchedDataDict, greedy: bool = False, uniforms: torch.Tensor | None = None
    ) -> BatchedDataDict:
        """This worker's rows; `uniforms` [b, N] are the rows' slice of the driver's U (None when greedy)."""
        self.engine.prepare_for_generation()
        return self.engine.generate(data, greedy, uniforms=uniforms)

    def generate_shard(
        self, shard: tuple[BatchedDataDict, torch.Tensor | None], greedy: bool = False
    ) -> BatchedDataDict:
        """`generate` on a (rows, their uniforms) pair: the driver's per-worker shard."""
        rows, uniforms = shard
        return self.generate(rows, greedy, uniforms)

    def finish_generation(self) -> bool:
        return self.engine.finish_generation()

    def get_weights_version(self) -> int:
        return int(self._source.weights_version)

    def set_weights_version(self, version: int) -> bool:
        """Record the policy version the last refit delivered (the engine refuses to generate on another one)."""
        self._source.weights_version = int(version)
        self.engine.weights_changed()  # the refit wrote into the module in place: the bf16 copy must follow
        self.engine.prepare_for_generation()
        return True

    def set_kv_scales(self, kv_scales: dict[str, float] | None) -> bool:
        """The FP8 KV-cache scales the engine uses from the next generate() on (see `HfGeneration.set_kv_scales`)."""
        self.engine.set_kv_scales(kv_scales)
        return True

    def get_kv_scales(self) -> dict[str, float] | None:
        return self.engine.kv_scales

    def weight_digests(self) -> refit_digest.Digests:
        """Refit verification's report: digests of what this worker generates from, computed on its device."""
        return self.engine.weight_digests(self._delivered)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's weights on the CPU (tests compare them with the policy's)."""
        return {k: v.detach().cpu().clone() for k, v in self._source.model.state_dict().items()}

    # ------------------------------------------------------------------ refit receiver side
    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Copy a published snapshot (policy precision, as the collective would send it) into the module and
        generate as `version` from now on: the asynchronous producer's refit to an older version than the policy's."""
        start = time.perf_counter()
        refit.load_into_module(self._source.model)(list(state.items()))
        self.set_weights_version(version)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - start}

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> bool:
        """Keep the manifest `{name: (shape, dtype)}` the training side will send; every name must exist here."""
        live = self._source.model.state_dict()
        missing = [n for n in state_dict_info if n not in live]
        if missing:
            raise ValueError(f"refit manifest names {len(missing)} tensors this model lacks, e.g. {missing[0]!r}")
        self._refit_info = {n: e if isinstance(e, str) else (tuple(e[0]), e[1]) for n, e in state_dict_info.items()}
        return True

    def _manifest(self) -> refit.RefitInfo:
        if self._refit_info is None:
            raise RuntimeError("refit before prepare_refit_info: the worker has no manifest")
        return self._refit_info

    def _manifest_bytes(self) -> int:
        return refit.wire_bytes(self._manifest())  # a tied tensor travels once

    def update_weights_via_ipc_zmq(self) -> dict[str, float]:
        """Receive one refit from the training rank of this node and local rank; returns bytes and seconds."""
        info = self._manifest()
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        address = refit.ipc_address(refit.device_ipc_tag(self.device, local_rank))
        start = time.perf_counter()
        ok = refit.receive_weights_via_ipc_zmq(address, info, refit.load_into_module(self._source.model))
        if not ok:
            raise RuntimeError(f"generation worker {self.rank}: ZMQ IPC refit on {address} failed or timed out")
        return {"bytes": float(self._manifest_bytes()), "seconds": time.perf_counter() - start}

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> bool:
        """Join the weight-update group (reference numbering: rank train_world_size + this worker's rank of
        `world_size`) as rank 1 + this worker's rank of the generation workers and training rank 0."""
        rank = train_world_size + self.rank
        if not 0 < train_world_size <= rank < world_size:
            raise ValueError(
                f"init_collective: generation worker {self.rank} would be rank {rank}, outside "
                f"[{train_world_size}, {world_size})"
            )
        world = refit.collective_world(world_size, train_world_size)
        self._weight_group = refit.WeightUpdateGroup(ip, port, 1 + self.rank, world)
        return True

    def update_weights_from_collective(self) -> dict[str, float]:
        """Receive training rank 0's broadcast into the module (and its FP8 KV scales, when it sent any);
        returns bytes and seconds."""
        if self._weight_group is None:
            raise RuntimeError("update_weights_from_collective: call init_collective first")
        start = time.perf_counter()
        kv_scales = self._weight_group.receive_weights(self._manifest(), refit.load_into_module(self._source.model))
        if kv_scales is not None:
            self.engine.set_kv_scales(kv_scales)
        return {"bytes": float(self._manifest_bytes()), "seconds": time.perf_counter() - start}

    def shutdown(self) -> bool:
        if self._weight_group is not None:
            self._weight_group.destroy()
            self._weight_group = None
        self.engine.shutdown()
        return True

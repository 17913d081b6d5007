"""DistributedGeneration: the driver's generation engine over a group of `GenerationWorker`s (Ray or in-process).

`generate` draws the sampling uniforms `U [B, N]` once from the façade's own generator and hands each worker a
contiguous block of rows with their rows of U, so the stitched `GenerationOutputSpec` is what an `HfGeneration`
would return for the whole batch (a row's sample depends only on its prompt, the weights and its row of U), and
`get_rng_state` / `set_rng_state` let a resumed run sample exactly what the uninterrupted one would have.

`prepare_for_generation` refits the workers whenever the policy's `weights_version` moved, so no rollout samples
from weights older than the policy's: colocated, every training rank streams its weights over ZMQ IPC to the worker
placed on its node with its local rank (paired by Ray node id); not colocated, training rank 0 broadcasts to the dedicated workers in one weight-update
group. Refit time and bytes are kept as `refit/*` metrics (`refit_metrics()`). How a refit is ordered, how
asynchronous GRPO's second engine (`snapshot_copy`) shares the workers, and how FP8 KV scales travel with a refit:
docs/design.md.
"""

from __future__ import annotations

import copy
import socket
import time
from collections.abc import Mapping
from typing import Any

import torch

from relayrl.config import ClusterConfig, GenerationConfig, PolicyConfig
from relayrl.distributed import refit_digest
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.executor import build_worker_group_on_nodes, run_all_async
from relayrl.distributed.interfaces import WorkerGroup
from relayrl.models.generation.interfaces import (
    GenerationDatumSpec,
    GenerationInterface,
    GenerationOutputSpec,
    RefitSource,
)
from relayrl.models.generation.outputs import assemble_output, empty_generation, generation_limits
from relayrl.models.generation.worker import GenerationWorker
from relayrl.utils import device as dev

#: ZMQ IPC refit budget: two ping-pong buffers of half of it each.
DEFAULT_REFIT_BUFFER_BYTES = 64 << 20


def generation_cluster(config: GenerationConfig, cluster: ClusterConfig) -> ClusterConfig:
    """The worker layout of the generation group: the policy's when colocated, else `colocated.resources`."""
    if config.colocated.enabled:
        return cluster
    res = config.colocated.resources
    if res.num_nodes is None or res.workers_per_node is None:
        raise ValueError(
            "policy.generation.colocated.enabled=false needs policy.generation.colocated.resources.num_nodes and "
            ".workers_per_node"
        )
    return cluster.model_copy(update={"num_nodes": res.num_nodes, "workers_per_node": res.workers_per_node})


def contiguous_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous blocks covering `rows` rows; the first `rows % parts` get one more."""
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class DistributedGeneration(GenerationInterface):
    """Generation on separate workers, kept in sync with `policy` by refit; same outputs as one `HfGeneration`."""

    def __init__(
        self,
        config: GenerationConfig,
        tokenizer: Any,
        policy: RefitSource,
        *,
        cluster: ClusterConfig,
        policy_config: PolicyConfig,
        max_total_sequence_length: int | None = None,
        seed: int = 0,
        refit_buffer_bytes: int = DEFAULT_REFIT_BUFFER_BYTES,
    ) -> None:
        if not isinstance(config, GenerationConfig):
            raise TypeError(f"config must be a relayrl GenerationConfig, got {type(config).__name__}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError("tokenizer has neither pad_token_id nor eos_token_id; cannot pad outputs")
        self.config = config
        self.pad_token_id = int(pad_id)
        self.max_total_sequence_length = max_total_sequence_length
        self.colocated = config.colocated.enabled
        self.refit_buffer_bytes = refit_buffer_bytes
        self._policy: RefitSource | None = policy  # None on a copy (snapshot_copy, a remote copy): no refit source
        self._refit_dtype = dev.precision_dtype(policy_config.precision)  # what the collective sends
        self._holder: list[DistributedGeneration | None] = [None]  # the engine whose weights the workers hold
        self._snapshot_refit = False  # True on a `snapshot_copy`: refitted by load_weights only
        self._generator = torch.Generator().manual_seed(seed)
        self._rng_delegate: Any = None  # set while a remote rollout actor samples with this engine's stream
        self._synced_version: int | None = None  # None: never refitted (fresh or random-init workers)
        self._metrics: dict[str, float] = {}
        self._totals = {"count": 0.0, "seconds": 0.0, "bytes": 0.0}
        self._kv_scales: dict[str, float] | None = None  # FP8 KV-cache scales for the workers (set_kv_scales)
        self._kv_scales_pending = False  # set since the workers last received them
        gen_cluster = generation_cluster(config, cluster)
        train_world = int(policy.dp_size)
        self._group: WorkerGroup[GenerationWorker] = build_worker_group_on_nodes(
            GenerationWorker,
            gen_cluster,
            policy.worker_group.node_ids if self.colocated else None,  # colocated: each worker on its rank's node
            policy_config=policy_config.model_copy(update={"generation": config}),
            tokenizer=tokenizer,
            device=cluster.device,
            max_total_sequence_length=max_total_sequence_length,
            seed=seed,
        )
        try:
            if self.colocated and self._group.world_size != train_world:
                raise ValueError(
                    f"colocated generation needs one worker per policy rank: {self._group.world_size} vs {train_world}"
                )
            manifest = policy.prepare_refit_info()
            if manifest is None:
                raise ValueError(f"{type(policy).__name__} describes no weights to refit generation workers from")
            self._group.run_all(GenerationWorker.prepare_refit_info, manifest)
            if not self.colocated:
                self._join_weight_group(policy, train_world)
        except BaseException:
            self._group.shutdown()
            raise

    def _join_weight_group(self, policy: RefitSource, train_world: int) -> None:
        """Training ranks 0..T-1 and generation workers T.. in one group, rendezvousing at training rank 0."""
        ip, port = _rank0_endpoint(policy)
        world = train_world + self._group.world_size
        training = policy.init_collective(ip, port, world, train_world_size=train_world)  # one per rank
        joined = run_all_async(
            self._group, GenerationWorker.init_collective, ip, port, world, train_world_size=train_world
        )
        for handle in training:
            handle.result()
        joined.result()

    # ------------------------------------------------------------------ state
    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def synced_weights_version(self) -> int | None:
        return self._synced_version

    def get_rng_state(self) -> torch.Tensor:
        """Sampling generator state (save it with a checkpoint for an exact resume)."""
        if self._rng_delegate is not None:
            return self._rng_delegate.get_rng_state()
        return self._generator.get_state().clone()

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self._rng_delegate is not None:
            self._rng_delegate.set_rng_state(state)
        else:
            self._generator.set_state(state.clone())

    def delegate_rng(self, delegate: Any) -> None:
        """While a copy of this engine samples elsewhere (a Ray rollout actor), its generator is the live one:
        `delegate.get_rng_state()` / `.set_rng_state()` reach it. None takes the stream back (state first)."""
        if delegate is None and self._rng_delegate is not None:
            self._generator.set_state(self._rng_delegate.get_rng_state().clone())
        self._rng_delegate = delegate

    @property
    def requires_kv_scale_sync(self) -> bool:
        """Whether the workers' caches are FP8 (`kv_cache_dtype=fp8`): calibrated scales should follow each refit."""
        return self.config.kv_cache_dtype == "fp8"

    def set_kv_scales(self, kv_scales: Mapping[str, float] | None) -> None:
        """FP8 KV-cache scales (a `calibrate_qkv_fp8_scales(...)["layers"]` dict) for the workers; they go out
        at the next prepare_for_generation (with the refit when the policy trained since the last one)."""
        self._kv_scales = None if kv_scales is None else {str(k): float(v) for k, v in kv_scales.items()}
        self._kv_scales_pending = True

    @property
    def kv_scales(self) -> dict[str, float] | None:
        """The FP8 scales last handed to `set_kv_scales` (a copy; None before any)."""
        return None if self._kv_scales is None else dict(self._kv_scales)

    def worker_kv_scales(self) -> list[dict[str, float] | None]:
        """The FP8 scales every worker's engine uses (None: none received)."""
        return self._group.run_all(GenerationWorker.get_kv_scales)

    def refit_metrics(self) -> dict[str, float]:
        """`refit/*` of the last refit (time, bytes received per worker, ms per MB) and running totals."""
        out = dict(self._metrics)
        out.update({f"refit/total_{k}": v for k, v in self._totals.items()})
        return out

    # ------------------------------------------------------------------ lifecycle
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Refit the workers if the policy trained since the last sync (or another engine loaded them since); then
        they generate on its weights."""
        if self._snapshot_refit:
            if self._synced_version is None or self._holder[0] is not self:
                raise RuntimeError("a snapshot engine generates only after load_weights put its weights on the workers")
            return True
        if self._policy is None:
            raise RuntimeError("prepare_for_generation runs on the driver's engine, not on a remote copy")
        version = int(self._policy.weights_version)
        how = "IPC refit" if self.colocated else "collective refit"
        if version != self._synced_version or self._holder[0] is not self:
            self._refit()
            self._group.run_all(GenerationWorker.set_weights_version, version)
            self._synced_version = version
            self._holder[0] = self
        elif self._kv_scales_pending:  # new scales for the weights the workers hold
            self._group.run_all(GenerationWorker.set_kv_scales, self._kv_scales)
        else:
            how = "last refit"
        self._kv_scales_pending = False
        self._verify(version, how)
        return True

    def worker_digests(self) -> list[refit_digest.Digests]:
        """Every worker's refit-verification report (digests of what it generates from), in worker order."""
        return self._group.run_all(GenerationWorker.weight_digests)

    def _verify(self, version: int, how: str) -> None:
        """`policy.generation.refit_verify`: every worker's weights (and FP8 scales) against the policy's."""
        mode = self.config.refit_verify
        if mode == "off":
            return
        actuals = self.worker_digests()
        expected = self._source().refit_digests(sorted(actuals[0]))
        expected.update(refit_digest.scale_digests(self._kv_scales))
        refit_digest.check(expected, actuals, mode=mode, where="generation", version=version, how=how)

    def _source(self) -> RefitSource:
        if self._policy is None:
            raise RuntimeError(
                "a copy of a generation engine (snapshot_copy, a remote copy) has no policy to refit from"
            )
        return self._policy

    def _refit(self) -> None:
        start = time.perf_counter()
        policy = self._source()
        if self.colocated:
            policy.offload_before_refit()
            receiving = run_all_async(self._group, GenerationWorker.update_weights_via_ipc_zmq)
            for handle in policy.stream_weights_via_ipc_zmq(self.refit_buffer_bytes):  # one per rank
                handle.result()
            received = receiving.result()
            policy.offload_after_refit()
            if self._kv_scales_pending:  # the IPC stream carries weights only
                self._group.run_all(GenerationWorker.set_kv_scales, self._kv_scales)
        else:  # the KV scales (None unless set) travel with the broadcast
            sending = policy.broadcast_weights_for_collective(self._kv_scales)  # one handle per training rank
            receiving = run_all_async(self._group, GenerationWorker.update_weights_from_collective)
            for handle in sending:
                handle.result()
            received = receiving.result()
        self._count_refit(start, received)

    def _count_refit(self, start: float, received: list[dict[str, float]]) -> None:
        seconds = time.perf_counter() - start
        nbytes = float(sum(r["bytes"] for r in received))
        self._metrics = {
            "refit/time_s": seconds,
            "refit/bytes": nbytes,
            "refit/ms_per_mb": 1e3 * seconds / max(nbytes / 2**20, 1e-9),
            "refit/colocated": float(self.colocated),
        }
        self._totals["count"] += 1
        self._totals["seconds"] += seconds
        self._totals["bytes"] += nbytes

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        self._group.run_all(GenerationWorker.finish_generation)
        return True

    # ------------------------------------------------------------------ the asynchronous producer's engine
    def snapshot_copy(self, seed: int) -> DistributedGeneration:
        """An engine over the same workers for the asynchronous producer: its own sampling generator (`seed`),
        refitted only by `load_weights`; it does not own the workers (its shutdown leaves them to this engine)."""
        twin = copy.copy(self)
        twin._policy, twin._rng_delegate, twin._synced_version = None, None, None
        twin._snapshot_refit = True
        twin._generator = torch.Generator().manual_seed(seed)
        twin._metrics, twin._totals = {}, {"count": 0.0, "seconds": 0.0, "bytes": 0.0}
        return twin

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Put a published snapshot (weights version `version`) on every worker, cast to the policy precision as
        the collective would send it, so a batch generated here matches one generated after a collective refit."""
        if not self._snapshot_refit:
            raise RuntimeError("load_weights is the snapshot engine's refit (snapshot_copy); this one uses the policy")
        start = time.perf_counter()
        cast = {name: t.detach().to(self._refit_dtype) for name, t in state.items()}
        received = self._group.run_all(GenerationWorker.load_weights, cast, int(version))
        self._holder[0] = self
        self._synced_version = int(version)
        self._count_refit(start, received)

    def shutdown(self) -> bool:
        if self._policy is not None:  # a remote copy does not own the workers
            self._group.shutdown()
        return True

    def worker_state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """Every worker's weights (tests compare them with the policy's after a refit)."""
        return self._group.run_all(GenerationWorker.state_dict)

    # ------------------------------------------------------------------ generate
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Continuations for every row, sharded contiguously over the workers; as `HfGeneration` on the batch."""
        for key in ("input_ids", "input_lengths"):
            if key not in data:
                raise ValueError(f"generate() input is missing {key!r}")
        input_ids = data["input_ids"]
        lengths = torch.as_tensor(data["input_lengths"]).cpu().long()
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be an integer tensor [B, S], got {getattr(input_ids, 'shape', None)}")
        batch, width = input_ids.shape
        limits = generation_limits(lengths, self.config.max_new_tokens, self.max_total_sequence_length)  # [B]
        max_new = int(limits.max()) if batch else self.config.max_new_tokens
        if batch == 0:
            return assemble_output(input_ids.cpu().long(), lengths, *empty_generation(max_new), self.pad_token_id)
        uniforms = None if greedy else torch.rand((batch, max_new), generator=self._generator)  # [B, N]
        shards = []
        for start, end in contiguous_bounds(batch, self._group.world_size):
            rows: BatchedDataDict[Any] = BatchedDataDict(
                {k: v[start:end].clone() if isinstance(v, torch.Tensor) else v[start:end] for k, v in data.items()}
            )  # clones: a view would ship the whole batch's storage to a remote worker
            shards.append((rows, None if uniforms is None else uniforms[start:end].clone()))
        parts = self._group.run_sharded(GenerationWorker.generate_shard, shards, greedy)
        return _merge(parts, width + max_new, self.pad_token_id)

    # ------------------------------------------------------------------ a copy for a remote rollout actor
    def __getstate__(self) -> dict[str, Any]:
        """What a copy needs to generate (the workers, the settings, the generator state), never the policy."""
        dropped = ("_policy", "_generator", "_rng_delegate", "_holder")
        state = {k: v for k, v in self.__dict__.items() if k not in dropped}
        return {**state, "_policy": None, "_rng_delegate": None, "_holder": [None], "_rng_state": self.get_rng_state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        rng = state.pop("_rng_state")
        self.__dict__.update(state)
        self._generator = torch.Generator()
        self._generator.set_state(rng)


def _merge(parts: list[BatchedDataDict], total_width: int, pad_id: int) -> BatchedDataDict[GenerationOutputSpec]:
    """Workers' outputs (each as wide as its own longest budget) right-padded to one width and concatenated."""
    ids, logprobs = [], []
    for p in parts:
        missing = total_width - p["output_ids"].shape[1]
        ids.append(torch.nn.functional.pad(p["output_ids"], (0, missing), value=pad_id))  # [b, W]
        logprobs.append(torch.nn.functional.pad(p["logprobs"], (0, missing), value=0.0))  # [b, W]
    merged: BatchedDataDict[GenerationOutputSpec] = BatchedDataDict(
        output_ids=torch.cat(ids),
        logprobs=torch.cat(logprobs),
        generation_lengths=torch.cat([p["generation_lengths"] for p in parts]),
        unpadded_sequence_lengths=torch.cat([p["unpadded_sequence_lengths"] for p in parts]),
        truncated=torch.cat([p["truncated"] for p in parts]),
    )
    if parts and "support" in parts[0]:  # the sampler's kept sets [b, W, K]: zeros (nothing recorded) as padding
        pad = [(0, 0, 0, total_width - p["support"].shape[1]) for p in parts]
        merged["support"] = torch.cat([torch.nn.functional.pad(p["support"], w) for p, w in zip(parts, pad)])
    return merged


def _rank0_endpoint(policy: RefitSource) -> tuple[str, int]:
    """Where training rank 0 can host the weight-update group's store: its node's IP and a port free there."""
    group = policy.worker_group
    actor = getattr(group, "actor", None)
    if callable(actor):  # Ray: ask the actor hosting rank 0 (it may run on another node than the driver)
        from relayrl.distributed.ray_executor import get_within

        timeout_s: float = group.call_timeout_s  # type: ignore[attr-defined]  # a RayWorkerGroup here
        info = get_within(actor(0).node_info.remote(), timeout_s, "training rank 0's address", "cluster.call_timeout_s")
        return str(info["ip"]), int(info["port"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1", int(s.getsockname()[1])

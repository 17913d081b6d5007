"""The collective refit (generation workers not colocated with training): one broadcast from training rank 0.

A standalone gloo group (its own TCPStore: it is not the default group, so it can span processes of different Ray
groups) of training rank 0 (group rank 0, the source) and the generation workers (group ranks 1..G). The other
training ranks hold the same weights (every data-parallel rank keeps the full module) and are not members: they
neither receive nor allocate a refit. `init_collective` keeps its reference signature (`world_size` = training
ranks + generation workers, `train_world_size`); `collective_world` maps it onto the group.

Tensors (a tied one once) are concatenated into byte buckets of about `bucket_bytes`; a small header (bucket sizes,
a manifest digest, the KV-scale payload size) is broadcast first so receivers can always drain every bucket, then
check the digest instead of hanging on a mismatched manifest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from relayrl.distributed.refit_manifest import (
    LoadFn,
    RefitInfo,
    as_bytes,
    nbytes,
    tensor_from,
    ties,
    unique_tensors,
    wire_entries,
    with_ties,
)
from relayrl.utils import deadlines


def collective_world(world_size: int, train_world_size: int) -> int:
    """The broadcast group's size for a reference-style `world_size` (training ranks + generation workers): the
    generation workers and training rank 0."""
    return world_size - train_world_size + 1


class TrainerRefit:
    """A training rank's side of the collective refit: rank 0 is the group's source; any other rank is no member
    (its `broadcast` returns at once)."""

    def __init__(self, ip: str, port: int, world_size: int, *, train_world_size: int, rank: int) -> None:
        if not 0 <= rank < train_world_size < world_size:
            raise ValueError(
                f"init_collective: training rank {rank} needs 0 <= rank < train_world_size={train_world_size} "
                f"< world_size={world_size}"
            )
        world = collective_world(world_size, train_world_size)
        self.group = WeightUpdateGroup(ip, port, 0, world) if rank == 0 else None

    def broadcast(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        dtype: torch.dtype | None = None,
        kv_scales: dict[str, float] | None = None,
    ) -> dict[str, int] | None:
        """Rank 0: send the weights (and KV scales) to the generation workers; other ranks: nothing (None)."""
        if self.group is None:
            return None
        return self.group.send_weights(named_tensors, dtype=dtype, kv_scales=kv_scales)


def _digest(info: RefitInfo) -> int:
    text = json.dumps([[n, e] if isinstance(e, str) else [n, list(e[0]), str(e[1])] for n, e in info.items()]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


class WeightUpdateGroup:
    """A gloo group of one source (rank 0: training rank 0) and the generation workers (ranks 1..)."""

    def __init__(self, ip: str, port: int, rank: int, world_size: int, *, timeout_s: float | None = None) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"weight-update group: rank {rank} is not in a world of size {world_size} (need >= 2)")
        if timeout_s is None:  # the configured deadline (gloo's own timeout bounds every broadcast of the group)
            timeout_s = deadlines.deadline("collective").seconds
        self._deadline = deadlines.Deadline(timeout_s, "cluster.collective_timeout_s")
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(ip, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("relayrl-refit", self._store), rank, world_size, timeout)
        self.rank = rank
        self.world_size = world_size

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            self._pg.broadcast([tensor], _root(0)).wait()  # type: ignore[attr-defined]
        except RuntimeError as exc:  # gloo's own timeout: one line naming the refit's rank
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
            what = f"weight-update group rank {self.rank} of {self.world_size}: the refit's broadcast"
            raise self._deadline.error(what) from exc

    def send_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 64 << 20,
        kv_scales: dict[str, float] | None = None,
    ) -> dict[str, int]:
        """Rank 0: broadcast every tensor (packed) and the optional KV scales; returns bytes and buckets."""
        if self.rank != 0:
            raise RuntimeError(f"send_weights runs on rank 0 of the weight-update group, not rank {self.rank}")
        info: RefitInfo = {}
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for name, tensor in unique_tensors(named_tensors):
            if isinstance(tensor, str):  # tied to a tensor already packed: named in the manifest digest only
                info[name] = tensor
                continue
            raw = as_bytes(tensor, dtype)
            info[name] = (tuple(tensor.shape), dtype or tensor.dtype)
            buckets[-1].append(raw)
            size += raw.numel()
            if size >= bucket_bytes:
                buckets.append([])
                size = 0
        packed = [torch.cat(b) for b in buckets if b]
        kv = json.dumps(kv_scales).encode() if kv_scales is not None else b""
        self._broadcast(torch.tensor([len(packed)], dtype=torch.int64))
        self._broadcast(torch.tensor([p.numel() for p in packed] + [len(kv), _digest(info)], dtype=torch.int64))
        for p in packed:
            self._broadcast(p)
        if kv:
            self._broadcast(torch.frombuffer(bytearray(kv), dtype=torch.uint8))
        return {"bytes": sum(p.numel() for p in packed), "buckets": len(packed)}

    def receive_weights(self, state_dict_info: RefitInfo, load_weights: LoadFn | None) -> dict[str, float] | None:
        """A generation worker: receive rank 0's broadcast, load it (None: discard), return the KV scales if sent.

        Raises ValueError (after draining every bucket, so the group stays usable) when the sender's manifest
        differs from `state_dict_info`.
        """
        count = torch.zeros(1, dtype=torch.int64)
        self._broadcast(count)
        sizes = torch.zeros(int(count) + 2, dtype=torch.int64)
        self._broadcast(sizes)
        *bucket_sizes, kv_len, digest = (int(x) for x in sizes)
        packed = []
        for n in bucket_sizes:
            buf = torch.empty(n, dtype=torch.uint8)
            self._broadcast(buf)
            packed.append(buf)
        kv: dict[str, float] | None = None
        if kv_len:
            buf = torch.empty(kv_len, dtype=torch.uint8)
            self._broadcast(buf)
            kv = json.loads(bytes(buf.numpy()))
        if digest != _digest(state_dict_info):
            raise ValueError("weight-update group: the sender's tensors (names/shapes/dtypes) differ from the manifest")
        if load_weights is not None:
            items, tied = iter(wire_entries(state_dict_info).items()), ties(state_dict_info)
            for buf in packed:
                offset, batch = 0, []
                while offset < buf.numel():
                    name, (shape, dtype) = next(items)
                    batch.append((name, tensor_from(buf, offset, shape, dtype)))
                    offset += nbytes(shape, dtype)
                load_weights(with_ties(batch, tied))
        return kv

    def destroy(self) -> None:
        """Drop the group (sockets close when the objects go)."""
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


def _root(rank: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    return opts

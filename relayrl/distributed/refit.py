"""Weight refit from training workers to generation workers that hold their own copy of the network.

Two transports, both driven by a manifest `{name: (shape, dtype)}` (`refit_info`) that the generation side gets
once (`prepare_refit_info`) and then uses to cut received bytes back into tensors:

* ZMQ IPC (colocated: same host): the training worker binds a REQ socket on an `ipc://` path, the generation
  worker connects a REP socket. Tensors are packed as raw bytes at 512-byte aligned offsets into size-bounded
  buckets (two ping-pong buffers of half the budget: one is in flight while the next fills); a tensor larger than
  a half buffer goes alone. Each bucket is `(json header with names and used bytes, payload)`; the receiver
  validates names against the manifest, loads, and ACKs; a final COMPLETE checks every expected tensor arrived.
  Without CUDA IPC handles the payload travels through the socket (a copy) - correct on CPU and on GPUs.
* Collective (not colocated): a standalone gloo group (its own TCPStore: it is not the default group, so it can
  span processes of different Ray groups) with training rank 0 as the source. Tensors are concatenated into byte
  buckets of about `bucket_bytes`; a small header (bucket sizes, a manifest digest, the KV-scale payload size)
  is broadcast first so receivers can always drain every bucket, then check the digest instead of hanging on a
  mismatched manifest.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from relayrl.utils import deadlines

if TYPE_CHECKING:  # pyzmq is the Ray refit's transport only: imported on use, so a CPU install can leave it out
    import zmq

RefitInfo = dict[str, tuple[tuple[int, ...], torch.dtype]]
LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]
ALIGN = 512
COMPLETE = b"COMPLETE"
IPC_DIR_ENV = "RELAYRL_REFIT_IPC_DIR"
#: The Ray node id of a rank's node, set in its environment by the Ray executor (pairs colocated refit sockets).
NODE_ID_ENV = "RELAYRL_NODE_ID"


def refit_info(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> RefitInfo:
    """The manifest of what will be streamed: names in order, shapes, and the dtype each tensor is sent in."""
    return {name: (tuple(t.shape), dtype or t.dtype) for name, t in named_tensors}


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A flat uint8 CPU view of `t` cast to `dtype` (the wire format)."""
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous().cpu().reshape(-1).view(torch.uint8)


def _tensor_from(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """View bytes [offset, offset+nbytes) of `buf` as a tensor; misaligned slices are cloned first."""
    n = _nbytes(shape, dtype)
    piece = buf[offset : offset + n]
    if offset % torch.empty((), dtype=dtype).element_size():
        piece = piece.clone()
    return piece.view(dtype).view(shape)


def load_into_module(module: torch.nn.Module) -> LoadFn:
    """A `load_weights` callback copying received tensors into `module`'s state dict entries in place."""
    live = module.state_dict(keep_vars=True)

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in batch:
                if name not in live:
                    raise KeyError(f"received weight {name!r} has no entry in {type(module).__name__}")
                live[name].copy_(tensor)

    return load


# ---------------------------------------------------------------------------------------------------- ZMQ IPC
def device_ipc_tag(device: torch.device, local_rank: int, node: str | None = None) -> str:
    """What pairs a training worker with the generation worker on the same device: the GPU UUID, or on the
    CPU the node and local rank (both sides must use the same local rank). The node is the Ray node id `node`, else
    the one the executor put in the rank's environment (RELAYRL_NODE_ID: host names need not tell nodes apart), its
    first 8 hex digits (Ray draws node ids at random; a socket path has at most 107 bytes), else the host name."""
    if device.type == "cuda":
        return f"gpu-{torch.cuda.get_device_properties(device).uuid}"
    node = node or os.environ.get(NODE_ID_ENV)
    return f"{node[:8] if node else socket.gethostname()}-cpu{local_rank}"


def private_ipc_dir() -> str:
    """The directory of this run's refit sockets.

    RELAYRL_REFIT_IPC_DIR when set (by the user, or by the driver for the Ray ranks it starts: the executor
    forwards RELAYRL_* variables), else a fresh private directory (mode 0700, `tempfile.mkdtemp`) that becomes
    RELAYRL_REFIT_IPC_DIR for this process and every rank it starts afterwards, removed when the process exits.
    So two runs on one host or one Ray cluster never share a socket path, and no other user can reach a socket.
    """
    current = os.environ.get(IPC_DIR_ENV)
    if current:
        return current
    path = tempfile.mkdtemp(prefix="relayrl-refit-")
    os.environ[IPC_DIR_ENV] = path
    atexit.register(shutil.rmtree, path, True)
    return path


def ipc_address(tag: str, directory: str | None = None) -> str:
    """The `ipc://` path both sides of one device derive from the same tag, in `directory`, else in
    `private_ipc_dir()` (made here, mode 0700, on a node other than the driver's)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)
    root = directory or private_ipc_dir()
    os.makedirs(root, mode=0o700, exist_ok=True)
    return f"ipc://{os.path.join(root, f'relayrl-refit-{safe}.sock')}"


def _zmq_deadline(timeout_ms: int | None) -> deadlines.Deadline:
    if timeout_ms is None:
        return deadlines.deadline("collective")
    return deadlines.Deadline(timeout_ms / 1000, "timeout_ms")


def _socket(ctx: zmq.Context[Any], kind: int, timeout_ms: int) -> zmq.Socket[Any]:
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def stream_weights_via_ipc_zmq(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    address: str,
    buffer_size_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    timeout_ms: int | None = None,
) -> dict[str, int]:
    """Send every tensor to the generation worker listening on `address`; returns bytes and bucket counts.

    Raises RuntimeError when the receiver reports a failure and DeadlineError when it does not answer within
    `timeout_ms` (None: `cluster.collective_timeout_s`) per message.
    """
    half = _aligned(max(buffer_size_bytes // 2, 1))
    if buffer_size_bytes < 2 * ALIGN:
        raise ValueError(f"buffer_size_bytes must be at least {2 * ALIGN}, got {buffer_size_bytes}")
    import zmq

    ctx: zmq.Context[Any] = zmq.Context.instance()
    limit = _zmq_deadline(timeout_ms)
    sock = _socket(ctx, zmq.REQ, int(limit.seconds * 1000))
    sock.bind(address)
    buffers = [torch.empty(half, dtype=torch.uint8), torch.empty(half, dtype=torch.uint8)]  # ping-pong
    state = {"current": 0, "in_flight": False, "buckets": 0, "bytes": 0}
    names: list[str] = []
    used = 0

    def await_ack() -> None:
        if state["in_flight"]:
            reply = sock.recv()
            state["in_flight"] = False
            if reply != b"OK":
                raise RuntimeError(f"generation worker rejected a weight bucket: {reply.decode(errors='replace')}")

    def send(payload: torch.Tensor, bucket_names: list[str], nbytes: int) -> None:
        await_ack()  # the other buffer's bucket must have been consumed before it is refilled
        header = json.dumps({"names": bucket_names, "used": nbytes}).encode()
        # zero-copy: the buffer is not touched again before this bucket's ACK arrives
        sock.send_multipart([header, memoryview(payload[:nbytes].numpy())], copy=False)  # type: ignore[arg-type]
        state.update(in_flight=True, buckets=state["buckets"] + 1, bytes=state["bytes"] + nbytes)

    try:
        for name, tensor in named_tensors:
            raw = _as_bytes(tensor, dtype)  # [nbytes]
            size = _aligned(raw.numel())
            if size > half:  # too big for a half buffer: flush, then send it alone and wait for it
                if names:
                    send(buffers[state["current"]], names, used)
                    state["current"] ^= 1
                    names, used = [], 0
                send(raw, [name], raw.numel())
                await_ack()
                continue
            if used + size > half:  # send() first awaited the other buffer's ACK, so it is free to refill
                send(buffers[state["current"]], names, used)
                state["current"] ^= 1
                names, used = [], 0
            buffers[state["current"]][used : used + raw.numel()] = raw
            names.append(name)
            used += size
        if names:
            send(buffers[state["current"]], names, used)
        await_ack()
        sock.send(COMPLETE)
        reply = sock.recv()
        if reply != b"OK":
            raise RuntimeError(f"generation worker failed to finish the refit: {reply.decode(errors='replace')}")
        return {"bytes": int(state["bytes"]), "buckets": int(state["buckets"])}
    except zmq.Again:
        what = f"refit over ZMQ IPC {address} (bucket {state['buckets']}): the generation worker's reply"
        raise limit.error(what) from None
    finally:
        sock.close(linger=0)


def receive_weights_via_ipc_zmq(
    address: str, state_dict_info: RefitInfo, load_weights: LoadFn, *, timeout_ms: int | None = None
) -> bool:
    """Receive one refit on `address` and load it; True when every expected tensor arrived and loaded. A sender
    that goes quiet for `timeout_ms` (None: `cluster.collective_timeout_s`) raises DeadlineError."""
    import zmq

    ctx: zmq.Context[Any] = zmq.Context.instance()
    limit = _zmq_deadline(timeout_ms)
    sock = _socket(ctx, zmq.REP, int(limit.seconds * 1000))
    sock.connect(address)
    loaded: set[str] = set()
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            if len(frames) == 1 and frames[0].bytes == COMPLETE:
                missing = [n for n in state_dict_info if n not in loaded]
                sock.send(
                    b"OK" if not missing else f"ERR: {len(missing)} tensors never arrived: {missing[:3]}".encode()
                )
                return not missing
            try:
                header = json.loads(frames[0].bytes)
                with warnings.catch_warnings():  # read-only zmq buffer: the views are only read from
                    warnings.simplefilter("ignore", UserWarning)
                    payload = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
                batch, offset = [], 0
                for name in header["names"]:
                    if name not in state_dict_info or name in loaded:
                        raise ValueError(f"unexpected or repeated tensor {name!r}")
                    shape, dtype = state_dict_info[name]
                    batch.append((name, _tensor_from(payload, offset, shape, dtype)))
                    offset += _aligned(_nbytes(shape, dtype))
                if _aligned(header["used"]) != offset:
                    raise ValueError(f"bucket holds {header['used']} bytes but its tensors need {offset}")
                load_weights(batch)
                loaded.update(header["names"])
                del batch, payload
            except Exception as exc:  # noqa: BLE001 - reported to the sender, then False
                sock.send(f"ERR: {type(exc).__name__}: {exc}".encode())
                return False
            sock.send(b"OK")
    except zmq.Again:
        what = f"refit over ZMQ IPC {address} ({len(loaded)} of {len(state_dict_info)} tensors in): the training rank's next bucket"
        raise limit.error(what) from None
    finally:
        sock.close(linger=0)


# ---------------------------------------------------------------------------------------------------- collective
def _digest(info: RefitInfo) -> int:
    text = json.dumps([[n, list(s), str(d)] for n, (s, d) in info.items()]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


class WeightUpdateGroup:
    """A gloo group of training ranks (0..train_world_size-1) and generation workers (the ranks after them)."""

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
        for name, tensor in named_tensors:
            raw = _as_bytes(tensor, dtype)
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
        """Every other rank: receive rank 0's broadcast, load it (None: discard), return the KV scales if sent.

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
            items = iter(state_dict_info.items())
            for buf in packed:
                offset, batch = 0, []
                while offset < buf.numel():
                    name, (shape, dtype) = next(items)
                    batch.append((name, _tensor_from(buf, offset, shape, dtype)))
                    offset += _nbytes(shape, dtype)
                load_weights(batch)
        return kv

    def destroy(self) -> None:
        """Drop the group (sockets close when the objects go)."""
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


def _root(rank: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    return opts

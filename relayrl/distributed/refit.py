"""Weight refit from training workers to generation workers that hold their own copy of the network.

Two transports, both driven by a manifest `{name: (shape, dtype)}` (`refit_info`) that the generation side gets
once (`prepare_refit_info`) and then uses to cut received bytes back into tensors. A tensor that is another's storage
under a second name (tied embeddings: `lm_head.weight` is `model.embed_tokens.weight`) is marked in the manifest by
the first name instead of a shape: it travels once, and the receiver hands it to `load_weights` under both names
(`load_into_module` copies it once when the receiving module is tied too, twice when it is not).

* ZMQ IPC (colocated: same host, same device): the training worker binds a REQ socket on an `ipc://` path, the
  generation worker connects a REP socket. Tensors are packed as raw bytes at 512-byte aligned offsets into
  size-bounded buckets (two ping-pong buffers of half the budget: one is in flight while the next fills); a tensor
  larger than a half buffer goes alone through the socket. The two buffers are shared with the receiver by handle
  (`refit_handles`: CUDA IPC handles on a GPU, a shared-memory file on the CPU), offered once per refit and mapped
  once: a bucket is then only a header `(names, used bytes, buffer index)` and the receiver reads the sender's
  buffer in place. Where handles cannot be used (the receiver cannot map them, no shared memory) each bucket's
  bytes travel through the socket, `(json header, payload)`; the choice is logged once. Either way the receiver
  validates names against the manifest, loads, and ACKs; a final COMPLETE checks every expected tensor arrived.
* Collective (not colocated): `refit_collective.WeightUpdateGroup`, one broadcast from training rank 0 to the
  generation workers (the other training ranks hold the same weights and are not in the group).
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import shutil
import socket
import tempfile
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from relayrl.distributed import refit_handles
from relayrl.distributed.refit_collective import TrainerRefit as TrainerRefit
from relayrl.distributed.refit_collective import WeightUpdateGroup as WeightUpdateGroup
from relayrl.distributed.refit_collective import collective_world as collective_world
from relayrl.distributed.refit_manifest import (
    ALIGN,
    aligned,
    as_bytes,
    nbytes,
    tensor_from,
    ties,
    unique_tensors,
    wire_entries,
    with_ties,
)
from relayrl.distributed.refit_manifest import Entry as Entry
from relayrl.distributed.refit_manifest import LoadFn as LoadFn
from relayrl.distributed.refit_manifest import RefitInfo as RefitInfo
from relayrl.distributed.refit_manifest import load_into_module as load_into_module
from relayrl.distributed.refit_manifest import refit_info as refit_info
from relayrl.distributed.refit_manifest import wire_bytes as wire_bytes
from relayrl.utils import deadlines

if TYPE_CHECKING:  # pyzmq is the Ray refit's transport only: imported on use, so a CPU install can leave it out
    import zmq

COMPLETE = b"COMPLETE"
HANDLES = b"HANDLES"  # first frame of the message that offers the shared buffers' handles
IPC_DIR_ENV = "RELAYRL_REFIT_IPC_DIR"
#: The Ray node id of a rank's node, set in its environment by the Ray executor (pairs colocated refit sockets).
NODE_ID_ENV = "RELAYRL_NODE_ID"


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
    # a receiver usually connects before the sender binds: retry every 2 ms, not after zmq's default 100 ms
    sock.setsockopt(zmq.RECONNECT_IVL, 2)
    return sock


def stream_weights_via_ipc_zmq(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    address: str,
    buffer_size_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    timeout_ms: int | None = None,
    handles: bool = True,
) -> dict[str, Any]:
    """Send every tensor (a tied one once) to the generation worker listening on `address`; returns bytes, bucket
    count and the transport used (`refit_handles` kind, or "socket"). `handles=False`: the socket copy always.

    Raises RuntimeError when the receiver reports a failure and DeadlineError when it does not answer within
    `timeout_ms` (None: `cluster.collective_timeout_s`) per message.
    """
    half = aligned(max(buffer_size_bytes // 2, 1))
    if buffer_size_bytes < 2 * ALIGN:
        raise ValueError(f"buffer_size_bytes must be at least {2 * ALIGN}, got {buffer_size_bytes}")
    import zmq

    sent = [(n, t) for n, t in unique_tensors(named_tensors) if isinstance(t, torch.Tensor)]  # ties: once
    device = sent[0][1].device if sent else torch.device("cpu")
    ctx: zmq.Context[Any] = zmq.Context.instance()
    limit = _zmq_deadline(timeout_ms)
    sock = _socket(ctx, zmq.REQ, int(limit.seconds * 1000))
    sock.bind(address)
    shared = refit_handles.sender_buffers(address, device, half) if handles else None
    buffers = shared.tensors if shared is not None else [torch.empty(half, dtype=torch.uint8) for _ in range(2)]
    state = {"current": 0, "in_flight": False, "buckets": 0, "bytes": 0}
    names: list[str] = []
    used = 0

    def await_ack() -> None:
        if state["in_flight"]:
            reply = sock.recv()
            state["in_flight"] = False
            if reply != b"OK":
                raise RuntimeError(f"generation worker rejected a weight bucket: {reply.decode(errors='replace')}")

    def send(payload: torch.Tensor, bucket_names: list[str], nbytes: int, index: int | None = None) -> None:
        await_ack()  # the other buffer's bucket must have been consumed before it is refilled
        head = {"names": bucket_names, "used": nbytes}
        if index is not None and shared is not None:  # the receiver reads buffer `index` in place
            refit_handles.written(payload)
            sock.send(json.dumps({**head, "buffer": index}).encode())
        else:  # zero-copy into zmq: the buffer is not touched again before this bucket's ACK arrives
            data = memoryview(payload[:nbytes].cpu().numpy())  # type: ignore[arg-type]
            sock.send_multipart([json.dumps(head).encode(), data], copy=False)  # type: ignore[list-item]
        state.update(in_flight=True, buckets=state["buckets"] + 1, bytes=state["bytes"] + nbytes)

    try:
        if shared is not None:  # offer the handles; a receiver that cannot map them gets the socket copy
            sock.send_multipart([HANDLES, pickle.dumps(shared.handles())])
            reply = sock.recv()
            if reply != b"OK":
                refit_handles.refused(address, shared, reply.decode(errors="replace"))
                shared = None
                buffers = [torch.empty(half, dtype=torch.uint8) for _ in range(2)]
            else:
                refit_handles.accepted(shared)
                refit_handles.chosen(address, shared.kind)
        where = device.type if shared is not None else "cpu"
        for name, tensor in sent:
            raw = as_bytes(tensor, dtype, where)  # [nbytes]
            size = aligned(raw.numel())
            if size > half:  # too big for a half buffer: flush, then send it alone through the socket
                if names:
                    send(buffers[state["current"]], names, used, state["current"])
                    state["current"] ^= 1
                    names, used = [], 0
                send(raw, [name], raw.numel())
                await_ack()
                continue
            if used + size > half:  # send() first awaited the other buffer's ACK, so it is free to refill
                send(buffers[state["current"]], names, used, state["current"])
                state["current"] ^= 1
                names, used = [], 0
            buffers[state["current"]][used : used + raw.numel()] = raw
            names.append(name)
            used += size
        if names:
            send(buffers[state["current"]], names, used, state["current"])
        await_ack()
        sock.send(COMPLETE)
        reply = sock.recv()
        if reply != b"OK":
            raise RuntimeError(f"generation worker failed to finish the refit: {reply.decode(errors='replace')}")
        kind = shared.kind if shared is not None else "socket"
        return {"bytes": int(state["bytes"]), "buckets": int(state["buckets"]), "transport": kind}
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
    entries, tied = wire_entries(state_dict_info), ties(state_dict_info)
    mapped: list[torch.Tensor] = []  # the sender's buffers, when it offered their handles
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
            if len(frames) == 2 and frames[0].bytes == HANDLES:
                try:
                    mapped = refit_handles.map_buffers(pickle.loads(frames[1].bytes))
                except Exception as exc:  # noqa: BLE001 - the sender falls back to the socket copy
                    sock.send(f"NO: {type(exc).__name__}: {exc}".encode())
                    continue
                sock.send(b"OK")
                continue
            try:
                header = json.loads(frames[0].bytes)
                if "buffer" in header:  # the bucket is in the sender's shared buffer
                    payload = mapped[header["buffer"]]
                else:
                    with warnings.catch_warnings():  # read-only zmq buffer: the views are only read from
                        warnings.simplefilter("ignore", UserWarning)
                        payload = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
                batch, offset = [], 0
                for name in header["names"]:
                    if name not in entries or name in loaded:
                        raise ValueError(f"unexpected or repeated tensor {name!r}")
                    shape, dtype = entries[name]
                    batch.append((name, tensor_from(payload, offset, shape, dtype)))
                    offset += aligned(nbytes(shape, dtype))
                if aligned(header["used"]) != offset:
                    raise ValueError(f"bucket holds {header['used']} bytes but its tensors need {offset}")
                batch = with_ties(batch, tied)
                load_weights(batch)
                refit_handles.read(payload)
                loaded.update(name for name, _ in batch)
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

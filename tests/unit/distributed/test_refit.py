"""Weight refit transports: ZMQ IPC buckets and the gloo weight-update group deliver bit-identical weights."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.algorithms.loss_functions import NLLLossFn
from relayrl.config import PolicyConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.distributed.refit import (
    TrainerRefit,
    WeightUpdateGroup,
    collective_world,
    ipc_address,
    load_into_module,
    receive_weights_via_ipc_zmq,
    refit_info,
    stream_weights_via_ipc_zmq,
)
from relayrl.models.policy.worker import PolicyWorker, load_causal_lm
from relayrl.utils.deadlines import DeadlineError
from tests.helpers import tight_deadlines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    return t, out


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, char_tokenizer) -> tuple[PolicyWorker, PolicyConfig]:
    """A policy worker after one optimizer step, so its weights differ from the checkpoint on disk."""
    cfg = PolicyConfig.model_validate(
        dict(model_name=str(tiny_model_dir), train_global_batch_size=4, train_micro_batch_size=2)
    )
    worker = PolicyWorker(cfg, char_tokenizer, init_reference_model=False)
    g = torch.Generator().manual_seed(0)
    data = BatchedDataDict(
        input_ids=torch.randint(2, len(char_tokenizer), (4, 10), generator=g),
        input_lengths=torch.tensor([10, 7, 4, 9]),
        token_mask=torch.ones(4, 10),
        sample_mask=torch.ones(4),
    )
    worker.train(data, NLLLossFn(), False, 4, 2)
    return worker, cfg


def receiver_model(cfg: PolicyConfig) -> torch.nn.Module:
    """The generation side's copy: the checkpoint on disk (stale: before the training step)."""
    return load_causal_lm(cfg)


def assert_bit_identical(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    mine, theirs = src.state_dict(), dst.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize(
    ("buffer_size", "handles"), [(4096, True), (64 << 20, False)]
)  # many buckets (+ oversize tensors alone through the socket) in shared memory / one bucket through the socket
def test_zmq_ipc_refit_is_bit_identical_and_sends_tied_weights_once(
    trained, tmp_path, buffer_size: int, handles: bool
) -> None:
    worker, cfg = trained
    dst = receiver_model(cfg)
    assert any(not torch.equal(v, dst.state_dict()[k]) for k, v in worker.model.state_dict().items())
    info = worker.prepare_refit_info()
    streamed = list(worker.model.state_dict().items())
    assert info == refit_info(streamed, torch.float32)  # the manifest describes exactly the streamed tensors
    assert info["lm_head.weight"] == "model.embed_tokens.weight"  # tied: marked, sent once
    address = ipc_address(f"cpu-{uuid.uuid4().hex[:6]}", str(tmp_path))
    t, got = in_thread(lambda: receive_weights_via_ipc_zmq(address, info, load_into_module(dst), timeout_ms=30_000))
    stats = stream_weights_via_ipc_zmq(
        streamed, address, buffer_size, dtype=torch.float32, timeout_ms=30_000, handles=handles
    )
    t.join(30)
    assert got == {"value": True}
    assert_bit_identical(worker.model, dst)
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()  # still tied
    unique = sum(v.numel() * 4 for k, v in streamed if k != "lm_head.weight")  # bytes on the wire: the tie once
    assert unique <= stats["bytes"] < unique + 512 * len(streamed) < unique + streamed[0][1].numel() * 4
    assert stats["transport"] == ("shm" if handles else "socket")
    assert (stats["buckets"] > len(streamed) // 2) if buffer_size == 4096 else (stats["buckets"] == 1)


def test_zmq_ipc_casts_to_the_manifest_dtype_and_reports_failures(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g)), ("c", torch.randn(300))]
    info = refit_info(tensors, torch.bfloat16)
    received: dict[str, torch.Tensor] = {}

    def collect(batch: list[tuple[str, torch.Tensor]]) -> None:
        received.update({n: t.clone() for n, t in batch})

    address = ipc_address(uuid.uuid4().hex[:6], str(tmp_path))
    t, got = in_thread(lambda: receive_weights_via_ipc_zmq(address, info, collect, timeout_ms=30_000))
    stream_weights_via_ipc_zmq(tensors, address, 1024, dtype=torch.bfloat16, timeout_ms=30_000)
    t.join(30)
    assert got == {"value": True}
    for name, tensor in tensors:
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], tensor.to(torch.bfloat16))
    # a receiver whose manifest lacks a tensor refuses the bucket: it returns False, the sender raises
    address = ipc_address(uuid.uuid4().hex[:6], str(tmp_path))
    partial = {k: v for k, v in info.items() if k != "b"}
    t, got = in_thread(lambda: receive_weights_via_ipc_zmq(address, partial, collect, timeout_ms=30_000))
    with pytest.raises(RuntimeError, match="unexpected or repeated tensor 'b'"):
        stream_weights_via_ipc_zmq(tensors, address, 1024, dtype=torch.bfloat16, timeout_ms=30_000)
    t.join(30)
    assert got == {"value": False}
    with pytest.raises(ValueError, match="buffer_size_bytes must be at least 1024"):
        stream_weights_via_ipc_zmq(tensors, address, 100)


def test_collective_refit_is_one_broadcast_from_rank0_to_generation_workers(trained) -> None:
    """Reference numbering (training ranks 0 and 1, one generation worker: world 3); the broadcast group is training
    rank 0 and the worker only: rank 1 joins nothing and receives nothing. The tied embedding travels once."""
    worker, cfg = trained
    dst = receiver_model(cfg)
    info = worker.prepare_refit_info()
    port = free_port()
    kv = {"model.layers.0.self_attn.k_scale": 0.0123, "model.layers.0.self_attn.v_scale": 1 / 3}
    replica = TrainerRefit("127.0.0.1", port, 3, train_world_size=2, rank=1)
    assert replica.group is None and replica.broadcast(worker.model.state_dict().items(), kv_scales=kv) is None

    def rank(r: int) -> Any:
        if r == 0:
            source = TrainerRefit("127.0.0.1", port, 3, train_world_size=2, rank=0)
            assert source.group is not None and source.group.world_size == collective_world(3, 2) == 2
            first = source.group.send_weights(worker.model.state_dict().items(), bucket_bytes=50_000, kv_scales=kv)
            return [first, source.broadcast(worker.model.state_dict().items())]  # two refits reuse the group
        group = WeightUpdateGroup("127.0.0.1", port, 1, collective_world(3, 2), timeout_s=60)
        return [group.receive_weights(info, load_into_module(dst)) for _ in range(2)]

    (t0, src), (t1, gen) = in_thread(lambda: rank(0)), in_thread(lambda: rank(1))
    t0.join(120)
    t1.join(120)
    assert "error" not in src and "error" not in gen, (src, gen)
    assert src["value"][0]["buckets"] > 1 and src["value"][1]["buckets"] == 1
    assert gen["value"] == [kv, None]  # KV scales arrive exactly (JSON float round trip)
    assert_bit_identical(worker.model, dst)
    tied = worker.model.lm_head.weight.numel() * 4
    everything = sum(v.numel() * 4 for v in worker.model.state_dict().values())
    assert src["value"][1]["bytes"] == everything - tied  # the tied embedding once


def test_collective_detects_a_mismatched_manifest_without_hanging() -> None:
    g = torch.Generator().manual_seed(2)
    tensors = [("w", torch.randn(3, 3, generator=g)), ("h", torch.randn(5, dtype=torch.float64, generator=g))]
    port = free_port()

    def rank(r: int) -> Any:
        group = WeightUpdateGroup("127.0.0.1", port, r, 2, timeout_s=60)
        if r == 0:
            group.send_weights(tensors)
            return group.send_weights(tensors)
        wrong = {"w": ((3, 3), torch.float32), "h": ((5,), torch.float32)}
        with pytest.raises(ValueError, match="differ from the manifest"):
            group.receive_weights(wrong, None)
        got: dict[str, torch.Tensor] = {}
        group.receive_weights(refit_info(tensors), lambda b: got.update({n: t.clone() for n, t in b}))
        return got

    (t0, out0), (t1, out1) = in_thread(lambda: rank(0)), in_thread(lambda: rank(1))
    t0.join(60)
    t1.join(60)
    assert "error" not in out0 and "error" not in out1, (out0, out1)
    assert all(torch.equal(out1["value"][n], t) for n, t in tensors)  # misaligned float64 slice cloned correctly
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        WeightUpdateGroup("127.0.0.1", port, 2, 2)


def test_a_refit_peer_that_never_answers_ends_with_one_line(tmp_path: Path, monkeypatch) -> None:
    """Issue 28 item 5: each ZMQ message waits at most cluster.collective_timeout_s; a generation worker that never
    connects, or a training rank that never sends, ends the refit with one line naming the socket and the key."""
    tight_deadlines(monkeypatch, collective_timeout_s=0.2)
    tensors = [("a", torch.randn(3, 5)), ("b", torch.randn(7))]
    address = ipc_address(uuid.uuid4().hex[:6], str(tmp_path))
    with pytest.raises(DeadlineError) as err:
        stream_weights_via_ipc_zmq(tensors, address, 1024)
    assert str(err.value) == (
        f"refit over ZMQ IPC {address} (bucket 0): the generation worker's reply did not finish within 0.2s "
        "(cluster.collective_timeout_s)"
    )
    address = ipc_address(uuid.uuid4().hex[:6], str(tmp_path))
    with pytest.raises(DeadlineError) as err:
        receive_weights_via_ipc_zmq(address, refit_info(tensors), lambda batch: None)
    assert str(err.value) == (
        f"refit over ZMQ IPC {address} (0 of 2 tensors in): the training rank's next bucket did not finish within "
        "0.2s (cluster.collective_timeout_s)"
    )


def test_shared_memory_refit_generates_what_the_socket_refit_does(trained, char_tokenizer, tmp_path, caplog) -> None:
    """Issue 27 item 4 on the CPU: the colocated refit by shared-memory handles (the receiver reads the sender's
    buffers in place) gives bit-identical generation to the socket copy; a receiver that cannot map the handles
    (their files gone) gets the socket copy, and the choice is logged once."""
    from relayrl.config import ColocatedConfig, GenerationConfig
    from relayrl.distributed import refit_handles
    from relayrl.models.generation.hf_generation import HfGeneration

    worker, cfg = trained
    streamed = list(worker.model.state_dict().items())
    info = worker.prepare_refit_info()
    prompts = BatchedDataDict(
        input_ids=torch.randint(2, len(char_tokenizer), (3, 6)), input_lengths=torch.tensor([6, 4, 5])
    )
    gen_cfg = GenerationConfig(max_new_tokens=8, colocated=ColocatedConfig(enabled=True))

    class Source:
        def __init__(self, model: torch.nn.Module) -> None:
            self.model, self.weights_version = model, 0

    def refit(handles: bool, address: str) -> tuple[dict[str, Any], Any]:
        dst = receiver_model(cfg)
        t, got = in_thread(lambda: receive_weights_via_ipc_zmq(address, info, load_into_module(dst), timeout_ms=30_000))
        stats = stream_weights_via_ipc_zmq(streamed, address, 1 << 16, timeout_ms=30_000, handles=handles)
        t.join(30)
        assert got == {"value": True}
        assert_bit_identical(worker.model, dst)
        return stats, HfGeneration(gen_cfg, char_tokenizer, Source(dst), seed=5).generate(prompts)

    address = ipc_address(uuid.uuid4().hex[:6], str(tmp_path))
    (shm, by_shm), (_, again) = refit(True, address), refit(True, address)  # buffers made once, refilled in place
    socket_stats, by_socket = refit(False, ipc_address(uuid.uuid4().hex[:6], str(tmp_path)))
    assert shm["transport"] == "shm" and socket_stats["transport"] == "socket" and shm["bytes"] == socket_stats["bytes"]
    for out in (again, by_socket):
        assert torch.equal(out["output_ids"], by_shm["output_ids"]) and torch.equal(out["logprobs"], by_shm["logprobs"])
    buffers = refit_handles.sender_buffers(address, torch.device("cpu"), 1 << 15)
    assert buffers is not None and buffers.kind == "shm" and buffers.mapped
    assert not any(Path(p).exists() for p in buffers.paths)  # mapped, then unlinked: nothing left in /dev/shm
    # a receiver that cannot map the handles: the socket copy, logged once
    gone = ipc_address(uuid.uuid4().hex[:6], str(tmp_path))
    lost = refit_handles.sender_buffers(gone, torch.device("cpu"), 1 << 15)
    assert lost is not None
    for path in lost.paths:
        Path(path).unlink()
    with caplog.at_level("INFO", logger="relayrl.distributed.refit_handles"):
        fallback, by_fallback = refit(True, gone)
        refit(True, gone)
    assert fallback["transport"] == "socket" and torch.equal(by_fallback["output_ids"], by_shm["output_ids"])
    lines = [r.getMessage() for r in caplog.records if gone in r.getMessage()]
    assert len(lines) == 1 and "socket copy (the generation worker cannot map shm handles" in lines[0]


def _cuda_receiver(address: str, info: dict[str, Any], out: Any) -> None:
    got: dict[str, torch.Tensor] = {}
    ok = receive_weights_via_ipc_zmq(
        address, info, lambda batch: got.update({n: t.cpu().clone() for n, t in batch}), timeout_ms=120_000
    )
    out.put((ok, got))


@pytest.mark.gpu
def test_cuda_ipc_refit_across_processes(tmp_path: Path) -> None:
    """On a GPU the colocated refit hands a receiver in another process CUDA IPC handles to the sender's buffers: the
    tensors arrive exactly, a tied one once, one larger than a half buffer through the socket."""
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(64, 32, generator=g).cuda()
    tensors = [
        ("emb", emb),
        ("w", torch.randn(300_000, generator=g).cuda()),
        ("b", torch.randn(7).cuda()),
        ("head", emb),
    ]
    info = refit_info(tensors)
    address = ipc_address(uuid.uuid4().hex[:6], str(tmp_path))
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_cuda_receiver, args=(address, info, out))
    child.start()
    stats = stream_weights_via_ipc_zmq(tensors, address, 1 << 20, timeout_ms=120_000)
    ok, got = out.get(timeout=180)
    child.join(60)
    assert ok and stats["transport"] == "cuda_ipc" and stats["buckets"] == 3  # emb | w alone | b
    assert all(torch.equal(got[n], t.cpu()) for n, t in tensors)

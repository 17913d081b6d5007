"""Refit time across processes on one node: async GRPO's generation process (the staging copy made at start vs a fresh
shared-memory segment per tensor and refit, what `ProcessGeneration.load_weights` did before), and the colocated ZMQ
refit to a generation worker in another process (the bytes through the socket vs shared-memory handles, issue 27
item 4: the receiver reads this process's buffers in place), in ms per MiB.

Why: on the local executor, async GRPO's producer refits its generation process from the trainer's published
snapshot before every batch. The refit sits on the producer's critical path, and its CPU on this side is taken
from the trainer's process. Both grow with the model.

For each model size: one `ProcessGeneration` (1 torch thread), `--refits` refits of fresh snapshots, alternating the
two paths refit by refit so a shared box disturbs both alike; wall seconds and this process's CPU seconds per refit,
medians, and their ratios. Sizes are random Qwen2s with relayrl's character tokenizer: `1m` (the shipped model's
shape), `25m` (the bench's 25M: hidden 512, 6 layers, MLP 2048), `134m` (hidden 1024, 8 layers, MLP 4096).

The ZMQ part: a spawned child holds a copy of the model and receives `--refits` refits per transport, alternating,
with the default 64 MiB buffer; wall ms per MiB of what travels (the tied embedding once) and this process's CPU ms
per MiB, medians after the first refit of each, and their ratios.

    python bench/process_refit.py --refits 12 [--parts staging zmq]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as torch_mp
from model_shapes import WIDE_25M, WIDE_134M  # bench/model_shapes.py

from relayrl.config import ColocatedConfig, GenerationConfig
from relayrl.distributed import refit
from relayrl.models.generation.distributed import DEFAULT_REFIT_BUFFER_BYTES
from relayrl.models.generation.process_generation import ProcessGeneration
from relayrl.models.tiny import build_char_tokenizer, build_tiny_qwen2, count_parameters

SIZES: dict[str, dict[str, int]] = {
    "1m": {},
    "25m": WIDE_25M,
    "134m": WIDE_134M,
}


def measure(size: str, refits: int) -> None:
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(len(tokenizer), seed=1, **SIZES[size])  # type: ignore[arg-type]
    engine = ProcessGeneration(
        GenerationConfig(colocated=ColocatedConfig(enabled=False)),
        tokenizer,
        model,
        0,
        max_total_sequence_length=128,
        seed=1,
        num_threads=1,
        deterministic=True,
    )
    paths = {
        "staged": lambda state, v: engine.load_weights(state, v),
        # the former path: the snapshot itself is sent, each tensor moved into a new shared-memory segment
        "per-refit segments": lambda state, v: engine._call("load_weights", dict(state), v),
    }
    wall: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for version in range(1, 2 * refits + 1):
            name = list(paths)[version % 2]
            snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}  # as the trainer publishes
            t, c = time.perf_counter(), time.process_time()
            paths[name](snapshot, version)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    finally:
        engine.shutdown()
    med = {n: (statistics.median(wall[n][1:]), statistics.median(cpu[n][1:])) for n in paths}
    print(f"{size:>5s} ({count_parameters(model) / 1e6:.1f}M params)", end="")
    for n, (w, c) in med.items():
        print(f" | {n}: {w * 1e3:.1f} ms wall, {c * 1e3:.1f} ms CPU", end="")
    (ws, cs), (wo, co) = med["staged"], med["per-refit segments"]
    print(f" | staged/former: wall {ws / wo:.2f}, CPU {cs / max(co, 1e-9):.2f}")


def _zmq_receiver(conn: object, size: str) -> None:
    """Child: a generation-side copy of the model, refitted on every address the parent sends (None: stop)."""
    torch.set_num_threads(1)
    model = build_tiny_qwen2(len(build_char_tokenizer()), seed=2, **SIZES[size])  # type: ignore[arg-type]
    info = refit.refit_info(model.state_dict().items())
    load = refit.load_into_module(model)
    while (address := conn.recv()) is not None:  # type: ignore[attr-defined]
        conn.send(refit.receive_weights_via_ipc_zmq(address, info, load))  # type: ignore[attr-defined]


def measure_zmq(size: str, refits: int) -> None:
    model = build_tiny_qwen2(len(build_char_tokenizer()), seed=1, **SIZES[size])  # type: ignore[arg-type]
    mib = refit.wire_bytes(refit.refit_info(model.state_dict().items())) / 2**20
    ctx = torch_mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_zmq_receiver, args=(child_conn, size), daemon=True)
    child.start()
    wall: dict[str, list[float]] = {"socket": [], "shm": []}
    cpu: dict[str, list[float]] = {"socket": [], "shm": []}
    try:
        for i in range(2 * refits):
            kind = ("socket", "shm")[i % 2]
            address = refit.ipc_address(f"bench-process-refit-{kind}")
            conn.send(address)
            t, c = time.perf_counter(), time.process_time()
            stats = refit.stream_weights_via_ipc_zmq(
                model.state_dict().items(), address, DEFAULT_REFIT_BUFFER_BYTES, handles=kind == "shm"
            )
            ok = conn.recv()
            wall[kind].append(time.perf_counter() - t)
            cpu[kind].append(time.process_time() - c)
            assert ok and stats["transport"] == kind, (ok, stats)
    finally:
        conn.send(None)
        child.join(timeout=60)
    med = {k: (1e3 * statistics.median(wall[k][1:]) / mib, 1e3 * statistics.median(cpu[k][1:]) / mib) for k in wall}
    print(f"{size:>5s} ZMQ refit to another process ({mib:.1f} MiB)", end="")
    for k, (w, c) in med.items():
        print(f" | {k}: {w:.2f} ms/MiB wall, {c:.2f} ms/MiB CPU", end="")
    print(f" | shm/socket: wall {med['shm'][0] / med['socket'][0]:.2f}, CPU {med['shm'][1] / med['socket'][1]:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--refits", type=int, default=12, help="refits per path and size (the first is discarded)")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--parts", nargs="+", default=["staging", "zmq"], choices=["staging", "zmq"])
    args = p.parse_args()
    torch.set_num_threads(1)
    for size in args.sizes:
        if "staging" in args.parts:
            measure(size, args.refits)
        if "zmq" in args.parts:
            measure_zmq(size, args.refits)


if __name__ == "__main__":
    main()

"""Benchmark: one GRPO step through each data-plane backend, against a plain in-process torch copy as the floor.

Workload (issue 4): 512 samples with lengths uniform in 256..2048, per-token `input_ids` (int64), `token_mask`
(bool) and `generation_logprobs` (float32), packed jagged as a rollout writes them (~7.5 MB). One step:

    put        the driver writes the batch
    get_dp4    4 DP shards (`shard_meta_for_dp`) are fetched by 4 workers
    write_back each worker writes a float32 per-token column (`prev_logprobs`) under its keys (~2.3 MB)
    clear      the driver clears the step's keys

Backends: `torch` (the floor: one private copy per put and write-back, one slice/gather per shard),
`memory`, `ray` and `transfer_queue`. For `ray` and `transfer_queue` the 4 workers are Ray actors in their own
processes fetching and writing at the same time; for `torch` and `memory` the driver fetches the 4 shards itself
(an in-process store serves only its own process). Backends run interleaved, the order rotating every repetition,
so load from other processes hits all alike. Clients are the bare backends (no metrics wrapper). Every backend's
first step is checked bit-exact. Medians of the repetitions after warm-up are printed per phase and per step
(the median of per-step totals), then the ratios the acceptance quotes. Torch runs with 1 intra-op thread by
default: on a busy 2-core box a second thread makes a 1 MB copy 30-100x slower.

    python bench/data_plane.py [--samples 512] [--reps 7] [--warmup 2] [--threads 1]
                               [--backends torch,memory,ray,transfer_queue]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta
from relayrl.data_plane.preshard import shard_meta_for_dp

FIELDS = ["input_ids", "token_mask", "generation_logprobs"]
WRITE_BACK = "prev_logprobs"
PHASES = ["put", "get_dp4", "write_back", "clear"]
PID = "train"
ALL = ["torch", "memory", "ray", "transfer_queue"]


def make_batch(n: int, lo: int, hi: int, seed: int) -> tuple[list[str], dict[str, Column], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g)  # [N]
    t = int(lens.sum())
    fields = {
        "input_ids": Column(torch.randint(0, 150_000, (t,), generator=g), lens),
        "token_mask": Column(torch.rand(t, generator=g) > 0.3, lens),
        "generation_logprobs": Column(-torch.rand(t, generator=g) * 8, lens),
    }
    return [f"u{i // 8}_g{i % 8}" for i in range(n)], fields, lens


def write_back_column(lens: torch.Tensor, seed: int) -> Column:
    g = torch.Generator().manual_seed(seed)
    return Column(-torch.rand(int(lens.sum()), generator=g) * 8, lens.clone())


# ---------------------------------------------------------------------------------------------------- the floor
class TorchFloor:
    """What any in-process store must at least do: one private copy of each put, a key → row index, one
    slice (contiguous keys) or one gather per field per fetch, one private copy of each write-back."""

    def put(self, keys: list[str], fields: dict[str, Column]) -> None:
        self.rows = {k: i for i, k in enumerate(keys)}
        self.cols = {name: (c.values.clone(), c.offsets) for name, c in fields.items()}
        self.written: list[Column] = []

    def get(self, keys: list[str]) -> dict[str, Column]:
        rows = torch.tensor([self.rows[k] for k in keys], dtype=torch.int64)
        out = {}
        for name, (values, offsets) in self.cols.items():
            starts, ends = offsets.index_select(0, rows), offsets.index_select(0, rows + 1)
            lens = ends - starts
            if bool((rows.diff() == 1).all()):
                out[name] = Column(values[int(starts[0]) : int(ends[-1])].clone(), lens)
            else:
                flat = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(starts, ends)])
                out[name] = Column(values.index_select(0, flat), lens)
        return out

    def write_back(self, col: Column) -> None:
        self.written.append(Column(col.values.clone(), col.lengths))

    def clear(self) -> None:
        self.rows, self.cols, self.written = {}, {}, []


# ---------------------------------------------------------------------------------------------------- workers
def backend_cfg(name: str) -> DataPlaneConfig:
    return DataPlaneConfig(enabled=True, backend=name, storage_capacity=100_000)  # type: ignore[arg-type]


def build(name: str, bootstrap: bool) -> DataPlaneClient:
    if name == "memory":
        from relayrl.data_plane.memory import build_client as build_memory

        return build_memory(backend_cfg(name), bootstrap=bootstrap)
    if name == "ray":
        from relayrl.data_plane.ray_store import build_client as build_ray

        return build_ray(backend_cfg(name), bootstrap=bootstrap)
    from relayrl.data_plane.tq_adapter import build_client as build_tq

    return build_tq(backend_cfg(name), bootstrap=bootstrap)


class DPWorker:
    """One data-parallel rank in its own Ray process, attached to every remote backend."""

    def __init__(self, backends: list[str], rank: int, threads: int):
        torch.set_num_threads(threads)
        self.clients = {b: build(b, bootstrap=False) for b in backends}
        self.rank = rank
        self.got: dict[str, Column] = {}
        self.wb: Column | None = None

    def pid(self) -> int:
        return os.getpid()

    def fetch(self, backend: str, shard: KVBatchMeta) -> None:
        self.got = self.clients[backend].get_samples(shard.keys, shard.partition_id, FIELDS)

    def prepare(self, step: int) -> tuple[dict[str, Column], Column]:
        """Untimed: build this rank's write-back; returns what was fetched and what will be written (checks)."""
        lens = self.got["input_ids"].lengths
        assert lens is not None
        self.wb = write_back_column(lens, seed=1000 * step + self.rank)
        return self.got, self.wb

    def write_back(self, backend: str, shard: KVBatchMeta) -> None:
        assert self.wb is not None
        self.clients[backend].put_samples(shard.keys, shard.partition_id, {WRITE_BACK: self.wb})

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


# ---------------------------------------------------------------------------------------------------- one step
def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def check_equal(got: Column, want: Column, what: str) -> None:
    ok = got.dtype == want.dtype and torch.equal(got.values, want.values)
    ok = ok and (got.lengths is None) == (want.lengths is None)
    ok = ok and (got.lengths is None or torch.equal(got.lengths, want.lengths))  # type: ignore[arg-type]
    if not ok:
        raise AssertionError(f"bit-exact check failed: {what}")


class StepBatch(NamedTuple):
    """What every timed step puts: the samples' keys, their columns, and the DP shards of their metadata."""

    keys: list[str]
    fields: dict[str, Column]
    shards: list[KVBatchMeta]


def step_local(name: str, client: Any, batch: StepBatch, step: int, verify: bool) -> dict[str, float]:
    """torch floor or memory: the driver fetches all 4 shards and writes all 4 write-backs."""
    keys, fields, shards = batch
    times: dict[str, float] = {}
    is_floor = isinstance(client, TorchFloor)
    shard_lens = [torch.tensor(s.sequence_lengths) for s in shards]
    wbs = [write_back_column(lens, seed=1000 * step + r) for r, lens in enumerate(shard_lens)]
    got: list[dict[str, Column]] = []
    times["put"] = _timed(lambda: client.put(keys, fields) if is_floor else client.put_samples(keys, PID, fields))
    if is_floor:
        times["get_dp4"] = _timed(lambda: got.extend(client.get(s.keys) for s in shards))
        times["write_back"] = _timed(lambda: [client.write_back(wb) for wb in wbs])
    else:
        times["get_dp4"] = _timed(lambda: got.extend(client.get_samples(s.keys, PID, FIELDS) for s in shards))
        times["write_back"] = _timed(
            lambda: [client.put_samples(s.keys, PID, {WRITE_BACK: wb}) for s, wb in zip(shards, wbs)]
        )
    if verify:
        verify_step(name, keys, fields, shards, got, wbs, None if is_floor else client)
    times["clear"] = _timed(lambda: client.clear() if is_floor else client.clear_samples(keys, PID))
    return times


def step_remote(
    name: str, client: Any, workers: list[Any], batch: StepBatch, step: int, verify: bool
) -> dict[str, float]:
    """ray or transfer_queue: 4 worker actors fetch and write back at the same time."""
    import ray

    keys, fields, shards = batch
    times: dict[str, float] = {}
    times["put"] = _timed(lambda: client.put_samples(keys, PID, fields))
    times["get_dp4"] = _timed(lambda: ray.get([w.fetch.remote(name, s) for w, s in zip(workers, shards)]))
    fetched = ray.get([w.prepare.remote(step) for w in workers])  # untimed
    times["write_back"] = _timed(lambda: ray.get([w.write_back.remote(name, s) for w, s in zip(workers, shards)]))
    if verify:
        verify_step(name, keys, fields, shards, [f[0] for f in fetched], [f[1] for f in fetched], client)
    n = len(keys)
    cleared: list[int] = []
    times["clear"] = _timed(lambda: cleared.append(client.clear_samples(keys, PID)))
    if cleared != [n]:
        raise AssertionError(f"{name}: clear removed {cleared} keys, expected {n}")
    return times


def verify_step(
    name: str,
    keys: list[str],
    fields: dict[str, Column],
    shards: list[KVBatchMeta],
    got: list[dict[str, Column]],
    wbs: list[Column],
    client: Any,
) -> None:
    pos = {k: i for i, k in enumerate(keys)}
    for r, (shard, batch) in enumerate(zip(shards, got)):
        idx = [pos[k] for k in shard.keys]
        for f in FIELDS:
            src = fields[f]
            want = Column(torch.cat([src.row(i) for i in idx]), src.lengths[idx])  # type: ignore[index]
            check_equal(batch[f], want, f"{name} rank {r} field {f}")
        if client is not None:
            back = client.get_samples(shard.keys, PID, [WRITE_BACK])[WRITE_BACK]
            check_equal(back, wbs[r], f"{name} rank {r} write-back")


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per backend (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backends", default=",".join(ALL))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in the driver and workers")
    parser.add_argument("--json", default=None, help="also write every repetition's phase times here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(ALL))
    if unknown or not backends:
        parser.error(f"unknown backend(s) {unknown}; choose from {ALL}")
    remote = [b for b in backends if b in ("ray", "transfer_queue")]

    keys, fields, lens = make_batch(args.samples, args.min_len, args.max_len, args.seed)
    meta = KVBatchMeta(PID, keys, list(FIELDS), lens.tolist())
    shards = shard_meta_for_dp(meta, args.dp)
    mb = sum(c.nbytes for c in fields.values()) / 1e6
    print(
        f"workload: {args.samples} samples, {int(lens.sum())} tokens, {mb:.2f} MB in {len(FIELDS)} jagged fields; "
        f"{args.dp} DP shards of {[s.size for s in shards]} rows; write-back {int(lens.sum()) * 4 / 1e6:.2f} MB"
    )

    ray_mod: Any = None
    clients: dict[str, Any] = {}
    workers: list[Any] = []
    t_setup = time.perf_counter()
    try:
        if remote:
            import ray as ray_mod

            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray_mod.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        for b in backends:
            clients[b] = TorchFloor() if b == "torch" else build(b, bootstrap=True)
            if b != "torch":
                clients[b].register_partition(PID, [*FIELDS, WRITE_BACK], args.samples, ["train"])
        if remote:
            actor_cls = ray_mod.remote(num_cpus=0)(DPWorker)
            workers = [actor_cls.remote(remote, r, args.threads) for r in range(args.dp)]
            pids = ray_mod.get([w.pid.remote() for w in workers], timeout=600)
            print(f"{remote}: {args.dp} DP workers are Ray actors in processes {pids} (driver {os.getpid()})")
        local = [b for b in backends if b not in remote]
        if local:
            print(f"{local}: the driver fetches the {args.dp} shards and writes the {args.dp} write-backs itself")
        print(f"setup: {time.perf_counter() - t_setup:.1f} s (Ray, TransferQueue and worker start-up; not timed below)")

        results: dict[str, list[dict[str, float]]] = {b: [] for b in backends}
        for rep in range(args.warmup + args.reps):
            order = backends[rep % len(backends) :] + backends[: rep % len(backends)]
            for b in order:
                verify = rep == 0
                if b in remote:
                    t = step_remote(b, clients[b], workers, StepBatch(keys, fields, shards), rep, verify)
                else:
                    t = step_local(b, clients[b], StepBatch(keys, fields, shards), rep, verify)
                if rep >= args.warmup:
                    results[b].append(t)
        print("bit-exact round trip verified on the first step of every backend")
        report(results, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "seconds": results}, f, indent=1)
    finally:
        for w in workers:
            try:
                ray_mod.get(w.close.remote(), timeout=60)
            except Exception:
                pass
        for c in clients.values():
            if not isinstance(c, TorchFloor):
                c.close()
        if ray_mod is not None and ray_mod.is_initialized():
            ray_mod.shutdown()


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    med: dict[str, dict[str, float]] = {}
    for b, reps in results.items():
        med[b] = {p: statistics.median(r[p] for r in reps) * 1e3 for p in PHASES}
        med[b]["step"] = statistics.median(sum(r[p] for p in PHASES) for r in reps) * 1e3
    cols = ["step", *PHASES]
    print(f"\nmedian of {args.reps} repetitions after {args.warmup} warm-up, milliseconds")
    print(f"{'backend':<16}" + "".join(f"{c:>12}" for c in cols))
    for b, m in med.items():
        print(f"{b:<16}" + "".join(f"{m[c]:>12.2f}" for c in cols))

    def ratio(a: str, b: str, target: str, ok: Callable[[float], bool]) -> None:
        if a not in med or b not in med:
            return
        per_phase = "  ".join(f"{p} {med[a][p] / med[b][p]:.1f}x" for p in PHASES)
        r = med[a]["step"] / med[b]["step"]
        print(f"{a + '/' + b:<28} step {r:6.2f}x   [{per_phase}]   target {target}: {'PASS' if ok(r) else 'FAIL'}")

    print("\nratios of medians (step: median of per-step totals)")
    ratio("memory", "torch", "memory within 3x of torch", lambda r: r <= 3.0)
    ratio("transfer_queue", "memory", "memory >= 20x faster", lambda r: r >= 20.0)
    ratio("transfer_queue", "ray", "ray >= 4x faster", lambda r: r >= 4.0)


if __name__ == "__main__":
    main()

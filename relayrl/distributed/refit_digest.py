"""Refit verification: a few bytes per tensor that say whether generation holds the weights the trainer holds.

Why: a refit that skips a tensor, an engine that keeps a stale copy, LoRA adapters never merged into the engine's
weights or a lossy cast on the way each leave generation sampling from other weights than the trainer's, while the
run looks healthy: the only symptom is a slowly growing generation-vs-training log-prob error. Each side digests its
tensors where they live (two integer reductions over the raw bits read as 64-bit words, on the tensor's device), so a check moves a few
bytes per tensor, never the weights, and equality is exact: a single flipped bit, a swapped pair or a value rounded
through a narrower dtype changes the digest.

An engine reports its digests keyed by what it generates from: the tensor's name, or `name@dtype` for a copy it
keeps in another dtype (the bf16 projection copies); the trainer digests its own tensors under the same keys
(`expected_digests`), casting where the key names a dtype. `kv_scales` entries carry FP8 KV-cache scales as floats.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal

import torch

#: (dtype name, sum of the tensor's 64-bit words, position-weighted sum of them), both modulo 2**64.
Digest = tuple[str, int, int]
Digests = dict[str, Digest]
Mode = Literal["enforce", "log", "off"]

_MOD = 1 << 64
_PERIOD = 251  # position weights cycle through 1..251 (a prime: a transposed matrix does not line up with it)
_CHUNK = _PERIOD * 16384  # elements reduced at once; a multiple of the period so every chunk starts at weight 1
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[torch.device, torch.Tensor] = {}

logger = logging.getLogger(__name__)


class RefitVerificationError(RuntimeError):
    """Generation's weights after a refit are not the trainer's (`policy.generation.refit_verify=enforce`)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _position_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        w = (torch.arange(_CHUNK, device=device, dtype=torch.int64) % _PERIOD) + 1  # [CHUNK]
        _weights[device] = w
    return w


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as int64 words [ceil(bytes / 8)], zero-padded at the end: a view where the bytes
    allow it (no conversion of each element to int64: a float32 tensor is read as half as many words)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)  # [bytes]
    pad = -raw.numel() % 8
    if pad or raw.storage_offset() % 8:  # a ragged tail or a misaligned slice of a larger buffer: one copy
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int64)


@torch.no_grad()
def _reduce(t: torch.Tensor) -> torch.Tensor:
    """[2] int64 on the tensor's device: the plain and the position-weighted sum of its bits read as 64-bit words
    (wrapping, so modulo 2**64 whatever the order of the additions)."""
    full = getattr(t, "full_tensor", None)
    if callable(full):  # a sharded DTensor: the whole tensor (a collective, so every rank must call it)
        t = full()
    words = _words(t)  # [W]
    out = torch.zeros(2, dtype=torch.int64, device=words.device)  # [2]
    w = _position_weights(words.device)
    for index, start in enumerate(range(0, words.numel(), _CHUNK)):
        part = words[start : start + _CHUNK]  # [<=CHUNK]
        out[0] += part.sum()
        weights = w[: part.numel()]
        # the CPU has an integer dot product (no [CHUNK] temporary); CUDA's dot is floating-point only
        weighted = torch.dot(part, weights) if part.device.type == "cpu" else (part * weights).sum()
        out[1] += weighted * (index + 1)
    return out


def _finish(t: torch.Tensor, reduced: list[int]) -> Digest:
    return dtype_name(t.dtype), reduced[0] % _MOD, reduced[1] % _MOD


def tensor_digest(t: torch.Tensor) -> Digest:
    """Digest of a tensor's values as stored (its dtype's bit patterns), computed on its device."""
    return _finish(t, _reduce(t).tolist())


def digest_all(named: Iterable[tuple[str, torch.Tensor]]) -> Digests:
    """Digests of many tensors with one host sync per device (not one per tensor)."""
    with _one_cpu_thread():
        return _digest_all(named)


@contextlib.contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """CPU reductions on one thread: a digest is hundreds of small reductions, and where ranks and generation
    workers share cores each one would otherwise wait at a thread barrier for a descheduled thread (bench/refit_verify
    measured milliseconds becoming hundreds of them)."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _digest_all(named: Iterable[tuple[str, torch.Tensor]]) -> Digests:
    pending: dict[torch.device, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for key, t in named:
        reduced = _reduce(t)
        pending.setdefault(reduced.device, []).append((key, t, reduced))
    out: Digests = {}
    for items in pending.values():
        values = torch.stack([r for _, _, r in items]).tolist()  # [T, 2]
        for (key, t, _), pair in zip(items, values, strict=True):
            out[key] = _finish(t, pair)
    return out


def parse_key(key: str) -> tuple[str, torch.dtype | None]:
    """(tensor name, dtype it is digested in or None for its own) of a digest key `name`, `name@dtype` or
    `name@dtype/compute` (an engine's compute-precision copy of the tensor)."""
    name, _, rest = key.partition("@")
    dtype = rest.partition("/")[0]
    return name, (getattr(torch, dtype) if dtype else None)


def expected_digests(named: Iterable[tuple[str, torch.Tensor]], keys: Iterable[str]) -> Digests:
    """The trainer's side: digests of `named` tensors under an engine's keys (cast where a key names a dtype).
    Keys whose tensor is absent are left out, which `compare` reports as missing."""
    wanted: dict[str, list[tuple[str, torch.dtype | None]]] = {}
    for key in keys:
        if key.startswith("kv_scales/"):
            continue
        name, dtype = parse_key(key)
        wanted.setdefault(name, []).append((key, dtype))
    return digest_all(
        (key, tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype))
        for name, tensor in named
        for key, dtype in wanted.get(name, ())
    )


def scale_digests(kv_scales: Mapping[str, float] | None) -> Digests:
    """FP8 KV-cache scales as digest entries (`kv_scales/<name>`: the float's exact bits)."""
    if not kv_scales:
        return {}
    return digest_all((f"kv_scales/{k}", torch.tensor([float(v)], dtype=torch.float64)) for k, v in kv_scales.items())


def compare(expected: Digests, actual: Digests) -> list[str]:
    """Keys where `actual` (an engine's) differs from `expected` (the trainer's), is missing, or has no counterpart."""
    bad = [k for k in actual if k not in expected or expected[k] != actual[k]]
    return bad + [k for k in expected if k not in actual]


def check(
    expected: Digests, actuals: list[Digests], *, mode: Mode, where: str, version: int | None, how: str
) -> list[str]:
    """Compare every generation worker's digests with the trainer's; on a mismatch raise (enforce) or log one line
    naming the first tensor, the worker, the weights version and the refit (`how`). Returns the mismatched keys.
    FP8 scales are compared when the trainer's side names any (an in-process engine is handed its scales directly)."""
    if mode == "off":
        return []
    scales_known = any(k.startswith("kv_scales/") for k in expected)  # an in-process engine's are its own
    for worker, actual in enumerate(actuals):
        if not scales_known:
            actual = {k: v for k, v in actual.items() if not k.startswith("kv_scales/")}
        bad = compare(expected, actual)
        if not bad:
            continue
        key = bad[0]
        state = "missing on the generation side" if key not in actual else "not the trainer's"
        if key not in expected and key in actual:
            state = "unknown to the trainer"
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        who = f"{where} worker {worker}" if len(actuals) > 1 else where
        msg = (
            f"refit verification failed: {key!r} on {who} is {state}{more} after the {how} to weights_version "
            f"{version}; generation would sample from other weights than the trainer's "
            "(policy.generation.refit_verify: enforce fails the step, log only logs, off skips the check)"
        )
        if mode == "enforce":
            raise RefitVerificationError(msg)
        logger.warning(msg)
        return bad
    return []

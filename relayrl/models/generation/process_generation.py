"""`ProcessGeneration`: an `HfGeneration` hosted in a child process, driven through a pipe.

Why: asynchronous GRPO overlaps generation with training. In one Python process the decode loop's per-token Python
and the training step's share one interpreter lock, so on a small model (where Python dominates) the two threads
mostly take turns and overlap buys nothing. In its own process the engine decodes on its own core while the trainer
trains on another.

The child is started with `spawn` (no fork of a process holding torch's thread pools), gets the policy's module once
(tensors travel through shared memory and the engine copies them into its own), applies the run's thread count and
determinism settings, and serves calls one at a time: `generate`, `load_weights` (a refit from a published weights
snapshot), the sampling RNG state, `shutdown`. It samples with the same code, the same thread count and the same
generator as an in-process engine, so it produces the same tokens (tested against the thread mode). A child that
raises hands back the error, which this side re-raises with the child's one-line reason; a child that dies is
reported with its exit code.

A refit goes through one shared-memory copy of the weights made at start (`_Staging`, a tied tensor once): this side
copies the snapshot into it, and the child's engine reads it in place (`HfGeneration.load_weights` adopts it).
Sending the snapshot itself would move every tensor into a fresh shared-memory segment on each refit (allocate,
fault in, copy, map in the child, unmap): more than twice the staged wall time and several times its CPU in the
trainer's process, growing with the model (`bench/process_refit.py`).
"""

from __future__ import annotations

import copy
import multiprocessing.connection
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch import nn

from relayrl.config import GenerationConfig
from relayrl.distributed import refit_manifest
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec
from relayrl.utils import deadlines

__all__ = ["GenerationProcessError", "ProcessGeneration"]


class GenerationProcessError(RuntimeError):
    """The generation process raised or exited; the message is its one-line reason."""


class _Pin:
    """The child engine's model source: its copy of the module and the weights version it generates as."""

    def __init__(self, model: nn.Module, version: int) -> None:
        self.model, self.weights_version = model, version


class _Staging:
    """One shared-memory copy of a module's state dict, the transfer buffer of every refit: the parent writes a
    snapshot into it, the child reads it, one request at a time (never both at once)."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in refit_manifest.unique_tensors(state.items()):  # a tied tensor: one staged copy, both names
            self.tensors[name] = (
                self.tensors[t] if isinstance(t, str) else torch.empty_like(t, device="cpu").share_memory_()
            )

    def fits(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether `state` has exactly the staged names, shapes and dtypes (else it is sent as it is)."""
        return state.keys() == self.tensors.keys() and all(
            t.shape == self.tensors[k].shape and t.dtype == self.tensors[k].dtype for k, t in state.items()
        )

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        written: set[int] = set()
        with torch.no_grad():
            for name, t in state.items():
                if id(self.tensors[name]) not in written:  # a tied tensor once
                    self.tensors[name].copy_(t)
                    written.add(id(self.tensors[name]))


def _serve(conn: multiprocessing.connection.Connection, init: dict[str, Any]) -> None:
    """Child process main loop: build the engine, then answer (method, args, kwargs) requests until shutdown."""
    from relayrl.models.generation.hf_generation import HfGeneration
    from relayrl.utils.device import apply_runtime_settings

    apply_runtime_settings(init["deterministic"], init["num_threads"], init["retain_freed_memory"])
    pin = _Pin(init["model"], init["version"])
    engine = HfGeneration(
        init["config"],
        init["tokenizer"],
        pin,
        device="cpu",
        max_total_sequence_length=init["max_total_sequence_length"],
        seed=init["seed"],
        precision=init["precision"],
    )
    pin.model = engine.model  # the engine's private copy; the shared-memory original is released
    del init["model"]
    staging: _Staging = init["staging"]

    def load_weights(state: Mapping[str, torch.Tensor] | None, version: int) -> None:
        engine.load_weights(staging.tensors if state is None else state, version)  # None: the staged snapshot
        pin.weights_version = version

    calls: dict[str, Callable[..., Any]] = {
        "generate": engine.generate,
        "load_weights": load_weights,
        "prepare_for_generation": engine.prepare_for_generation,
        "finish_generation": engine.finish_generation,
        "get_rng_state": engine.get_rng_state,
        "weight_digests": engine.weight_digests,
        "set_rng_state": engine.set_rng_state,
    }
    conn.send(("ok", None, time.process_time()))  # ready
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:  # the parent went away
            return
        if method == "shutdown":
            engine.shutdown()
            conn.send(("ok", True, time.process_time()))
            return
        try:
            result = calls[method](*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it as one line
            first = (str(exc).strip().splitlines() or [""])[0]
            conn.send(("error", f"{type(exc).__name__}: {first}", time.process_time()))
            continue
        conn.send(("ok", result, time.process_time()))


class ProcessGeneration:
    """The subset of `HfGeneration` an asynchronous producer drives, run in a child process (CPU only)."""

    def __init__(
        self,
        config: GenerationConfig,
        tokenizer: Any,
        model: nn.Module,
        version: int,
        *,
        max_total_sequence_length: int | None,
        seed: int,
        num_threads: int | None,
        deterministic: bool,
        retain_freed_memory: bool = True,
        precision: str = "float32",
    ) -> None:
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("ProcessGeneration runs on CPU; on a GPU generate in a thread (its own CUDA stream)")
        ctx = torch_mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._staging = _Staging(model.state_dict())
        init = {
            "staging": self._staging,
            "config": config,
            "tokenizer": tokenizer,
            "model": copy.deepcopy(model),  # pickling moves a tensor into shared memory: never the caller's module
            "version": int(version),
            "max_total_sequence_length": max_total_sequence_length,
            "seed": seed,
            "num_threads": num_threads,
            "deterministic": deterministic,
            "retain_freed_memory": retain_freed_memory,
            "precision": precision,
        }
        self._proc = ctx.Process(target=_serve, args=(child, init), name="relayrl-generation", daemon=True)
        self._lock = threading.RLock()  # one request in flight: a trainer-side checkpoint may ask for the RNG
        self._closed = False
        self._wedged = False  # a request ran past its deadline
        self.child_cpu_s = 0.0  # the child's CPU seconds so far (reported with every reply)
        self._proc.start()
        child.close()
        self._receive("start", "start")
        self.config = config

    # ------------------------------------------------------------------ transport
    def _receive(self, method: str, kind: deadlines.Kind = "call") -> Any:
        try:
            what = f"the generation process's {method!r} (pid {self._proc.pid})"
            status, payload, self.child_cpu_s = deadlines.recv(self._conn, what, kind)
        except deadlines.DeadlineError:
            self._wedged = True  # a late reply would answer the next request: the child is only stopped now
            raise
        except (EOFError, ConnectionError):
            self._proc.join(timeout=5)
            raise GenerationProcessError(
                f"generation process exited (code {self._proc.exitcode}) during {method}"
            ) from None
        if status == "error":
            raise GenerationProcessError(f"generation process failed in {method}: {payload}")
        return payload

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("generation engine is shut down")
        with deadlines.held(self._lock, f"the generation process's request lock (for {method!r})"):
            try:
                self._conn.send((method, args, kwargs))
            except (BrokenPipeError, ConnectionError):
                self._proc.join(timeout=5)
                raise GenerationProcessError(
                    f"generation process exited (code {self._proc.exitcode}) before {method}"
                ) from None
            return self._receive(method)

    # ------------------------------------------------------------------ engine API
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False, **kwargs: Any
    ) -> BatchedDataDict[GenerationOutputSpec]:
        return self._call("generate", data, greedy, **kwargs)  # type: ignore[no-any-return]

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Refit the child's copy from a weights snapshot, through the staging copy (a state of other names or
        shapes, which the child's load then refuses as a module would, travels as it is)."""
        if not self._staging.fits(state):
            self._call("load_weights", dict(state), int(version))
            return
        with deadlines.held(self._lock, "the generation process's request lock (for a refit)"):
            # written and read within one request: no other call comes between
            self._staging.write(state)
            self._call("load_weights", None, int(version))

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return bool(self._call("prepare_for_generation"))

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return bool(self._call("finish_generation"))

    def worker_digests(self) -> list[dict[str, tuple[str, int, int]]]:
        """Refit verification's report from the child: digests of what its engine generates from."""
        return [self._call("weight_digests")]

    def get_rng_state(self) -> torch.Tensor:
        return self._call("get_rng_state")  # type: ignore[no-any-return]

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._call("set_rng_state", state)

    def shutdown(self) -> bool:
        """Stop the child (politely, then by force); idempotent."""
        if self._closed:
            return True
        try:
            if self._proc.is_alive() and not self._wedged:
                self._call("shutdown")
        except (GenerationProcessError, deadlines.DeadlineError):
            pass
        finally:
            self._closed = True
            self._conn.close()
            if self._wedged:  # past a deadline: no clean exit to wait for
                self._proc.kill()
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=5)
        return True

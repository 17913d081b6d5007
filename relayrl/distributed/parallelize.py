"""Data-parallel wrapping of a worker's model, chosen by config (`<policy|value>.data_parallel.strategy`).

Every strategy keeps one loss normalisation, so the choice never changes the result: each micro-batch loss is a
partial sum of the global-batch mean, so the gradient of the global mean is the *sum* of the ranks' gradients.

* `manual` (default): plain module; `models/optim.py` sums the gradients with one flat all-reduce over the worker's
  `Collective` before clipping. Works on every executor (in-process threads included).
* `ddp`: `DistributedDataParallel` over the worker's torch.distributed process group, with a comm hook that sums
  instead of averaging (DDP divides by the world size; summing keeps the losses untouched and the result exact).
  Gradients are reduced once per global batch, in the backward of its last micro-batch (`no_sync` before).
* `fsdp2`: `fully_shard` on each decoder layer and on a root holding the rest; gradients are reduce-scattered with
  a divide factor of 1 (a sum) and the optimizer holds only this rank's shards (AdamW moments: 1/world each). The
  worker's plain module stays the *full* copy every other pass reads (logprobs, reference, refit, checkpoint,
  calibration: full HF-named tensors, no prefixes); after each optimizer step the updated shards are gathered into
  it in place (its identity, shared with a colocated engine, is kept).

Their collectives run inside torch (DDP's reducer, FSDP2's hooks), bounded by the process group's timeout
(`cluster.collective_timeout_s`); `_bounded` turns the backend's own timeout text (gloo's multi-line "Timed out
waiting ...ms for recv") into one `DeadlineError` line naming the rank, the strategy's collective and the phase.

DDP and FSDP2 reduce inside backward, so every rank must run the same micro-batches: a micro-batch without a valid
sample still runs, with its loss multiplied by 0, and is not recorded.
Both need a torch.distributed process group per worker group (the Ray executor: gloo on CPU, nccl on GPU); with one
rank there is nothing to reduce and every strategy runs as `manual`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from relayrl.distributed.torch_collective import is_backend_timeout
from relayrl.utils import deadlines

Strategy = Literal["manual", "ddp", "fsdp2"]
STRATEGIES: tuple[str, ...] = ("manual", "ddp", "fsdp2")


class _Closure(nn.Module):
    """Root module whose forward runs a loss closure over `inner`: DDP and FSDP2 hook into a module's forward, while
    the workers' training forward (packed backbone + chunked LM head) is a function of the module, not its forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, closure: Callable[[], Any]) -> Any:
        return closure()


def _sum_allreduce_hook(group, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    """DDP comm hook: element-wise *sum* of the bucket (a GradBucket) over ranks; DDP's default hook divides by the
    world size. Unannotated: DDP compares annotations with its classes, which postponed (string) annotations fail."""
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()  # type: ignore[union-attr]
    return fut.then(lambda f: f.value()[0])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (each becomes one FSDP2 unit): children of the first `layers` ModuleList."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList):
            return list(module)
    return []


class DataParallel:
    """One rank's training-side view of its model under a strategy (what `models/optim.py` drives).

    `module` is the worker's plain model (full weights; every non-training pass uses it). `train_module` is what the
    training loss closure must run on: `module` itself for manual/ddp, the sharded replica for fsdp2. `params` are
    what the optimizer holds and clipping sees.
    """

    def __init__(
        self,
        module: nn.Module,
        strategy: str,
        world_size: int,
        device: torch.device,
        deadline: deadlines.Deadline | None = None,
    ) -> None:
        """`deadline`: the process group's timeout and its key, named when a collective runs past it (None: the
        configured `cluster.collective_timeout_s`)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"data_parallel.strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
        if strategy != "manual" and world_size > 1 and not dist.is_initialized():
            raise ValueError(
                f"data_parallel.strategy={strategy!r} needs a torch.distributed process group per worker group "
                "(cluster.executor='ray'); in-process workers (cluster.executor='local') support only 'manual'"
            )
        self.module = module
        self.requested = strategy
        self.strategy = strategy if world_size > 1 else "manual"  # one rank: nothing to reduce
        self.world_size = world_size
        self._deadline = deadline or deadlines.deadline("collective")
        self.train_module: Any = module  # a PreTrainedModel / ValueModel; FSDP2 swaps in subclasses of its own
        self._wrapper: Any = None
        if self.strategy == "ddp":
            on_gpu = device.type == "cuda"
            ddp = nn.parallel.DistributedDataParallel(
                _Closure(module),
                device_ids=[device.index if device.index is not None else torch.cuda.current_device()]
                if on_gpu
                else None,
                broadcast_buffers=False,  # buffers (rotary tables) never change and start identical
                find_unused_parameters=False,
            )
            ddp.register_comm_hook(dist.group.WORLD, _sum_allreduce_hook)
            self._wrapper = ddp
        elif self.strategy == "fsdp2":
            self._wrapper = self._shard(module, device)
            self.train_module = self._wrapper.inner

    # ------------------------------------------------------------------ construction
    def _shard(self, module: nn.Module, device: torch.device) -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = init_device_mesh(device.type, (self.world_size,))
        replica = copy.deepcopy(module).to(device)  # [full] -> sharded below; `module` stays full
        for layer in decoder_layers(replica):
            fully_shard(layer, mesh=mesh)
        root: Any = fully_shard(_Closure(replica), mesh=mesh)
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum over ranks, like the manual all-reduce ...
                m.set_force_sum_reduction_for_comms(True)  # ... as a plain SUM (gloo has no PREMUL_SUM)
        # A rank whose micro-batch has no loss position may leave a unit's parameters (the LM head) without a
        # gradient; zeros keep its reduce-scatter the same shape as its peers'.
        root.set_reduce_scatter_unused_params(True)
        return root

    # ------------------------------------------------------------------ training-loop hooks
    @property
    def reduces_in_backward(self) -> bool:
        """Whether backward already sums gradients over ranks (no manual all-reduce before clipping)."""
        return self.strategy != "manual"

    @property
    def params(self) -> list[Any]:
        return [p for p in self.train_module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """Forward + backward of one micro-batch; gradients are reduced over ranks only when `sync`."""
        w = self._wrapper
        if w is None or sync:
            yield
        elif isinstance(w, nn.parallel.DistributedDataParallel):
            with w.no_sync():
                yield
        else:
            w.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                w.set_requires_gradient_sync(True)

    def forward(self, closure: Callable[[], Any], training: bool) -> Any:
        """Run the loss closure through the wrapper (whose hooks reduce gradients); DDP evaluation needs none."""
        if self._wrapper is None or (not training and self.strategy == "ddp"):
            return closure()
        # fsdp2 unshards the parameters here; ddp syncs its rebuilt bucket order once (its second training forward)
        phase = "parameter all-gather in forward" if self.strategy == "fsdp2" else "bucket sync in forward"
        with self._bounded(phase):
            return self._wrapper(closure)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`; under ddp/fsdp2 a synced micro-batch's gradient collectives run inside it."""
        phase = "gradient reduce-scatter" if self.strategy == "fsdp2" else "gradient all-reduce"
        with self._bounded(f"{phase} in backward"):
            loss.backward()

    def zero_touch(self) -> torch.Tensor:
        """0 x the parameters held unsharded right now (all of them under DDP; the root unit's inside an FSDP2
        forward): added to a loss without a graph (no loss position on this rank) so that backward still runs and
        reaches the gradient collectives its peers enter. Exactly zero gradients."""
        from torch.distributed.tensor import DTensor

        plain = [p.sum() for p in self.train_module.parameters() if p.requires_grad and not isinstance(p, DTensor)]
        return torch.stack(plain).sum() * 0.0

    def global_grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """Pre-clip global L2 norm (CPU scalar) of the already-reduced gradients, clipped in place."""
        with self._bounded("gradient norm all-reduce"):  # fsdp2: the norm sums over the shards
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            full = getattr(norm, "full_tensor", None)  # fsdp2: a DTensor norm over the shards
            return (full() if callable(full) else norm).detach().cpu()

    def after_step(self) -> None:
        """fsdp2: gather the updated shards into the full module in place (every rank takes part)."""
        if self.strategy != "fsdp2":
            return
        full = dict(self.module.named_parameters())
        with torch.no_grad(), self._bounded("parameter all-gather after the optimizer step"):
            for name, p in self.train_module.named_parameters():
                full[name].copy_(p.full_tensor())  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def _bounded(self, phase: str) -> Iterator[None]:
        """The backend's timeout of a ddp/fsdp2 collective as one `DeadlineError` line (rank, collective, phase,
        the key); other errors, and every error under `manual` (its all-reduce is the `Collective`'s), pass."""
        try:
            yield
        except RuntimeError as exc:
            if self.strategy == "manual" or not is_backend_timeout(exc):
                raise
            where = f"rank {dist.get_rank()} of {self.world_size}: {self.strategy} {phase} ({dist.get_backend()})"
            raise self._deadline.error(where) from exc

    def load_full_into_shards(self) -> None:
        """fsdp2: after the full module was overwritten (checkpoint load), re-cut this rank's shards from it."""
        if self.strategy != "fsdp2":
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        full = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, p in self.train_module.named_parameters():
                assert isinstance(p, DTensor)
                src = full[name].detach().to(p.device)
                p.to_local().copy_(distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None).to_local())

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer.state_dict()` with every sharded (fsdp2 DTensor) state tensor gathered whole.

        The result has the layout of a one-rank optimizer's state, so an optimizer checkpoint moves between strategies
        and rank counts. Under fsdp2 this is a collective: every rank must call it (rank 0 then writes the file)."""
        sd = optimizer.state_dict()
        if self.strategy != "fsdp2":
            return sd
        from torch.distributed.tensor import DTensor

        state = {
            idx: {k: (v.full_tensor().cpu() if isinstance(v, DTensor) else v) for k, v in st.items()}
            for idx, st in sd["state"].items()
        }
        return {**sd, "state": state}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        """Load a state from `full_optimizer_state`; under fsdp2 each rank cuts its shards from the whole tensors."""
        if self.strategy == "fsdp2":
            from torch.distributed.tensor import DTensor, distribute_tensor

            params = [p for group in optimizer.param_groups for p in group["params"]]
            state = {}
            for idx, st in sd["state"].items():
                p = params[int(idx)]
                if isinstance(p, DTensor):  # moments have the parameter's shape; scalars (step) stay as they are
                    st = {
                        k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                        if isinstance(v, torch.Tensor) and v.shape == p.shape
                        else v
                        for k, v in st.items()
                    }
                state[idx] = st
            sd = {**sd, "state": state}
        optimizer.load_state_dict(sd)


def wrap_model(model: nn.Module, strategy: str, comm: Any, device: torch.device) -> DataParallel:
    """`model` wrapped for data-parallel training under `strategy` over the ranks of `comm` (a `Collective`)."""
    deadline = getattr(comm, "deadline", None)  # a torch.distributed group's own timeout, where comm has one
    return DataParallel(model, strategy, int(comm.world_size), torch.device(device), deadline)

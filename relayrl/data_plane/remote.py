"""The Ray transport shared by the two Ray-hosted backends, `ray` and `transfer_queue`.

Both keep a `Ledger` in one named actor that every process attaches to by name: the `ray` backend's is the whole
`ColumnarStore` (`ray_store.StoreActor`), the TQ adapter's holds no tensors (a plain `LedgerHost`). This module is
both sides of that actor once:

- `LedgerHost`, the actor body: serves any public method of its ledger (or of itself) by name through one `call`
  method, and turns data-plane errors into a picklable `RemoteError`;
- `RemoteClient`, the client side: a `ProxyClient` whose transport is one actor call with a deadline, which
  re-raises each error as its own class (a dead actor as `DataPlaneClosedError`, an overrun as
  `ClaimTimeoutError`);
- the bootstrap helpers: a name unique to the run (`run_scoped`), find a named actor, start one and wait until it
  answers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ClassVar, Concatenate, ParamSpec, TypeVar, cast

import ray
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from relayrl.config import DataPlaneConfig
from relayrl.data_plane import interfaces as ifc
from relayrl.data_plane.interfaces import ClaimTimeoutError, DataPlaneClosedError, DataPlaneError
from relayrl.data_plane.ledger import Ledger
from relayrl.data_plane.proxy import DEFAULT_CALL_TIMEOUT_S, ProxyClient

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

NAMESPACE = "relayrl"
ACTOR_MAX_CONCURRENCY = 32
"""Threads per host actor: one worker's gather or a blocking `claim_meta` never stalls the others."""


# ---------------------------------------------------------------------------------------------------- errors
class RemoteError(Exception):
    """Picklable carrier for a data-plane error raised inside the actor (some error classes take extra init
    arguments and do not survive pickling); the client re-raises the original class."""

    def __init__(self, kind: str, message: str, missing: list[str] | None = None):
        super().__init__(kind, message, missing)
        self.kind, self.message, self.missing = kind, message, missing


def rebuild(err: RemoteError) -> Exception:
    """The original data-plane error carried by `err` (RuntimeError if its class is unknown here)."""
    cls = getattr(ifc, err.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, DataPlaneError)):
        return RuntimeError(f"{err.kind}: {err.message}")
    if err.missing is not None:
        return cls(err.message, err.missing)
    return cls(err.message)


def carry(fn: Callable[[], R]) -> R:
    """Run `fn` in the actor, turning data-plane errors into `RemoteError`."""
    try:
        return fn()
    except DataPlaneError as e:
        raise RemoteError(type(e).__name__, str(e), getattr(e, "missing", None)) from None


@functools.cache
def _signature(method: Callable[..., object]) -> inspect.Signature:
    return inspect.signature(method)


def call_name(method: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> str:
    """How a timed-out or failed ledger call is named: the method, and the partition it was for when it takes one
    (`claim_meta on partition 'train'`), so the line says which stream of the step stalled."""
    try:
        bound = _signature(method).bind_partial(None, *args, **kwargs)  # None: the unbound method's `self`
    except TypeError:
        return method.__name__
    pid = bound.arguments.get("partition_id")
    return method.__name__ if pid is None else f"{method.__name__} on partition {pid!r}"


def await_remote(ref: ray.ObjectRef[R], timeout_s: float, what: str) -> R:
    """`ray.get` with a deadline; an error raised in the actor comes back as its own class, a dead actor as
    `DataPlaneClosedError`, an overrun as `ClaimTimeoutError`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        try:
            ray.cancel(ref)
        except Exception:  # best effort: some actor tasks cannot be cancelled
            pass
        raise ClaimTimeoutError(f"{what} did not finish within {timeout_s:g}s (data_plane.call_timeout_s)") from None
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, RemoteError):
            raise rebuild(cause) from None
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except RayActorError as e:
        raise DataPlaneClosedError(f"{what}: the actor serving it is gone ({type(e).__name__})") from e


# ---------------------------------------------------------------------------------------------------- actor side
class LedgerHost:
    """Actor body hosting one ledger. `call(name, ...)` runs the host's own method of that name (wire forms,
    `reset`) or else the ledger's, so a new ledger method needs no forwarding code here."""

    def __init__(self, storage_capacity: int):
        self.ledger = self._new_ledger(storage_capacity)

    def _new_ledger(self, storage_capacity: int) -> Ledger:
        return Ledger(storage_capacity)

    def ping(self) -> bool:
        return True

    def call(self, method: str, *args: object, **kwargs: object) -> object:
        if method.startswith("_") or method == "call":
            raise AttributeError(f"{type(self).__name__} does not serve {method!r}")
        fn = getattr(self if hasattr(type(self), method) else self.ledger, method)
        return carry(lambda: fn(*args, **kwargs))

    def reset(self, storage_capacity: int | None) -> None:
        """Swap in an empty ledger (optionally with a new capacity); closing the old one wakes its blocked claims
        with `DataPlaneClosedError`."""
        old = self.ledger
        self.ledger = self._new_ledger(old.storage_capacity if storage_capacity is None else storage_capacity)
        old.close()


# ---------------------------------------------------------------------------------------------------- client side
class RemoteClient(ProxyClient):
    """A `ProxyClient` over a named `LedgerHost` actor; usable from any process of the Ray cluster."""

    _label: ClassVar[str] = "data plane"
    """How errors name this backend's calls (`"<label> <method> did not complete ..."`)."""

    def __init__(
        self,
        actor: ActorHandle[LedgerHost],
        *,
        owns_actor: bool,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        verify_checksums: bool = True,
    ):
        super().__init__(call_timeout_s, verify_checksums=verify_checksums)
        self._actor = actor
        self._owns_actor = owns_actor

    def _submit(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> ray.ObjectRef[R]:
        """Start one call without waiting (the TQ adapter overlaps a ledger check with its TQ call)."""
        self._check_open()
        ref: ray.ObjectRef[R] = self._actor.call.remote(method.__name__, *args, **kwargs)
        return ref

    def _wait(self, ref: ray.ObjectRef[R], what: str, timeout_s: float | None = None) -> R:
        return await_remote(ref, self._timeout if timeout_s is None else timeout_s, f"{self._label} {what}")

    def _call_within(
        self, timeout_s: float, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        return self._wait(self._submit(method, *args, **kwargs), call_name(method, args, kwargs), timeout_s)

    def reset(self, storage_capacity: int | None = None) -> None:
        """Drop every partition of the shared store (optionally changing its capacity), for every attached
        client at once. For tests and between runs; never while a step is in flight."""
        self._call(LedgerHost.reset, storage_capacity)

    def _stop_actor(self) -> None:
        """Best effort (the actor may be gone with its cluster): close the hosted ledger, then kill the actor."""
        try:
            ray.get(self._actor.call.remote("close"), timeout=self._timeout)
        except Exception:
            pass
        try:
            ray.kill(self._actor)
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------- bootstrap
def knob(cfg: DataPlaneConfig, name: str, given: R | None, default: R) -> R:
    """An explicit argument, else the config key if this config version has it, else the default."""
    if given is not None:
        return given
    value: R | None = getattr(cfg, name, None)
    return default if value is None else value


def run_scoped(name: str) -> str:
    """`name` made unique to this Ray job, i.e. to the driver's run: every process of the run (driver, workers,
    rollout actor: Ray runs them all under the driver's job) derives the same name, and a second driver on the
    same cluster another one, so two runs never attach to each other's store."""
    return f"{name}-{ray.get_runtime_context().get_job_id()}"


def lookup_actor(name: str, namespace: str = NAMESPACE) -> ActorHandle[LedgerHost] | None:
    try:
        handle: ActorHandle[LedgerHost] = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    return handle


def start_host(
    actor_class: ActorClass[LedgerHost], name: str, storage_capacity: int, ping_timeout_s: float, **options: object
) -> ActorHandle[LedgerHost]:
    """Start the named host actor (no CPU reserved, threaded) and wait until it answers; kill it if it does not."""
    options = dict(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=ACTOR_MAX_CONCURRENCY, **options)
    actor = cast("ActorHandle[LedgerHost]", actor_class.options(**options).remote(storage_capacity))
    try:
        ray.get(actor.ping.remote(), timeout=ping_timeout_s)
    except BaseException:
        ray.kill(actor)
        raise
    return actor

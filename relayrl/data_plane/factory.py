"""Config → client. `memory` is built here; `ray` and `transfer_queue` are imported lazily so that neither
Ray nor the transferqueue package is loaded unless selected.

Backend modules `relayrl.data_plane.ray_store` and `relayrl.data_plane.tq_adapter` each expose
`build_client(cfg: DataPlaneConfig, *, bootstrap: bool) -> DataPlaneClient`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.interfaces import DataPlaneClient

_LAZY_BACKENDS = {"ray": "relayrl.data_plane.ray_store", "transfer_queue": "relayrl.data_plane.tq_adapter"}


def validate_data_plane_config(cfg: DataPlaneConfig | Mapping[str, Any] | None) -> DataPlaneConfig:
    """Return a validated config or raise ValueError naming the bad key; a disabled data plane is an error."""
    if cfg is None:
        raise ValueError("data_plane config is missing; set data_plane.enabled=true and data_plane.backend")
    if isinstance(cfg, DataPlaneConfig):
        parsed = cfg
    elif isinstance(cfg, Mapping):
        try:
            parsed = DataPlaneConfig.model_validate(dict(cfg))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"invalid data_plane config: data_plane.{where}: {first['msg']}") from None
    else:
        raise TypeError(f"data_plane config must be a DataPlaneConfig or a dict, got {type(cfg).__name__}")
    if not parsed.enabled:
        raise ValueError(
            "the data plane is disabled (data_plane.enabled=false); enable it, or use the legacy GRPO trainer "
            "that moves batches through the driver"
        )
    return parsed


def build_data_plane_client(
    cfg: DataPlaneConfig | Mapping[str, Any] | None, *, bootstrap: bool = True, in_driver: bool | None = None
) -> DataPlaneClient:
    """Build the client for `cfg.backend`, wrapped with `data_plane/*` metrics.

    `bootstrap=True` (driver) creates the store; `bootstrap=False` (workers, rollout actors) attaches to it.
    Bytes moved through a client `in_driver` (default: a bootstrap client) count as bytes through the driver.
    """
    from relayrl.data_plane.metrics import MeteredDataPlaneClient

    parsed = validate_data_plane_config(cfg)
    inner: DataPlaneClient
    if parsed.backend == "memory":
        from relayrl.data_plane.memory import build_client as build_memory

        inner = build_memory(parsed, bootstrap=bootstrap)
    elif parsed.backend in _LAZY_BACKENDS:
        module = importlib.import_module(_LAZY_BACKENDS[parsed.backend])
        inner = module.build_client(parsed, bootstrap=bootstrap)
    else:  # unreachable while the config Literal matches; kept for configs built with model_construct
        raise ValueError(f"unknown data_plane backend: {parsed.backend!r} (expected memory, ray or transfer_queue)")
    return MeteredDataPlaneClient(inner, is_driver=bootstrap if in_driver is None else in_driver)


class _WorkerGroup(Protocol):
    def run_all(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

    def shutdown(self) -> bool: ...


class _AttachingWorker(Protocol):
    """What every data-plane worker offers (`worker.DataPlaneWorkerMixin`); groups dispatch by the method's name."""

    def setup_data_plane(self, cfg: DataPlaneConfig | Mapping[str, Any]) -> None: ...


def connect_driver_and_workers(group: _WorkerGroup, cfg: DataPlaneConfig, *, bootstrap: bool) -> DataPlaneClient:
    """A driver-side facade's client (counted as driver traffic), then every worker's own (`setup_data_plane`).

    If either step fails the client is closed and the group shut down, so a facade that cannot connect leaves
    nothing running."""
    try:
        client = build_data_plane_client(cfg, bootstrap=bootstrap, in_driver=True)
    except BaseException:
        group.shutdown()
        raise
    try:
        group.run_all(_AttachingWorker.setup_data_plane, cfg)
    except BaseException:
        client.close()
        group.shutdown()
        raise
    return client


def close_quietly(client: DataPlaneClient) -> None:
    """Close a facade's client on shutdown; a failure becomes a warning (the workers must still be shut down)."""
    try:
        client.close()
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"closing the data plane client failed: {exc}", stacklevel=3)

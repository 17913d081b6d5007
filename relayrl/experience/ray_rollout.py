"""The rollout actor on the Ray executor: `SyncRolloutActor` hosted in a Ray actor process.

On Ray the generation workers are actors too, so a rollout run in the driver would pull every generated batch into
the driver only to write it to the store again. Hosted as an actor, `rollout_to_tq` gathers the generation
workers' outputs, scores and flattens them, and writes the bulk to the (Ray) data plane itself; the driver gets
back what the local `SyncRolloutActor` returns (a meta, the per-row carry in its wire form, the rollout metrics).

The actor samples with a copy of the driver's `DistributedGeneration` (its workers and generator state; the
refit stays with the driver's engine, which still calls `prepare_for_generation`). While the actor lives, the
driver engine's `get_rng_state` / `set_rng_state` reach the actor's generator, so checkpoints keep an exact resume;
`shutdown` hands the stream back to the driver's engine.

Ray is imported only when the Ray executor is selected.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import torch

from relayrl.config import DataPlaneConfig, MasterConfig
from relayrl.data_plane.interfaces import KVBatchMeta
from relayrl.distributed.errors import ActorLostError
from relayrl.environments.reward_fn_env import RewardFunctionError
from relayrl.environments.tool_env import EnvironmentClassError
from relayrl.experience.flight_recorder import export_rows, import_rows
from relayrl.experience.sync_rollout_actor import SyncRolloutActor


def rollout_actor_cls(cfg: MasterConfig) -> Any:
    """The rollout actor class for the run's executor: `SyncRolloutActor` (local) or `RayRolloutActor` (Ray)."""
    return RayRolloutActor if cfg.cluster.executor == "ray" else SyncRolloutActor


class _HostedRolloutActor(SyncRolloutActor):
    """`SyncRolloutActor` inside the Ray actor, plus access to its generation engine's sampling stream."""

    def __init__(
        self,
        policy_generation: Any,
        tokenizer: Any,
        envs: tuple[str, Any],
        master_config: MasterConfig,
        dp_cfg: DataPlaneConfig,
        *,
        torch_num_threads: int | None,
        deterministic: bool,
    ) -> None:
        from relayrl.utils import device as dev

        dev.apply_runtime_settings(deterministic, torch_num_threads, master_config.cluster.retain_freed_memory)
        task_to_env = receive_environments(envs, master_config)
        super().__init__(policy_generation, tokenizer, task_to_env, master_config, dp_cfg)

    def shutdown(self) -> bool:
        for env in self.task_to_env.values():
            env.shutdown()
        return super().shutdown()

    def get_rng_state(self) -> torch.Tensor:
        return self.policy_generation.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.policy_generation.set_rng_state(state)

    def rollout(self, input_batch: Any, kwargs: dict[str, Any]) -> tuple[KVBatchMeta, dict[str, Any], dict[str, Any]]:
        names = kwargs.pop("task_to_env_override_names", None)
        if names is not None:  # the driver's override, by task name: this actor's own environments
            from relayrl.environments.registry import create_env

            for name in names:
                if name not in self.task_to_env:
                    self.task_to_env[name] = create_env(name, self.master_config.env)
            kwargs["task_to_env_override"] = {name: self.task_to_env[name] for name in names}
        return self.rollout_to_tq(input_batch, **kwargs)

    def ready(self) -> bool:
        return True

    def export_flight(self, batches: list[tuple[str, list[str]]]) -> dict[str, Any]:
        return {} if self.flight is None else export_rows(self.flight, batches)

    def import_flight(self, saved: dict[str, Any]) -> bool:
        if self.flight is not None:
            import_rows(self.flight, saved)
        return True


class RayRolloutActor:
    """Driver-side handle with `SyncRolloutActor`'s calls, running them in a Ray actor."""

    def __init__(
        self,
        policy_generation: Any,
        tokenizer: Any,
        task_to_env: dict[str, Any],
        master_config: MasterConfig,
        dp_cfg: DataPlaneConfig,
    ) -> None:
        import ray

        if not hasattr(policy_generation, "delegate_rng"):
            raise TypeError("RayRolloutActor needs Ray generation workers (DistributedGeneration)")
        self._ray = ray
        c = master_config.cluster
        from relayrl.distributed.ray_nodes import on_driver_node

        # on the driver's node: the driver calls it every step, and a lost node never holds it
        actor_cls = ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy=on_driver_node())(_HostedRolloutActor)
        envs = ship_environments(task_to_env)
        self._actor = actor_cls.remote(
            policy_generation,  # pickled as a copy: workers + generator state, never the policy
            tokenizer,
            envs,
            master_config,
            dp_cfg,
            torch_num_threads=c.torch_num_threads,
            deterministic=c.deterministic,
        )
        self._start_timeout_s, self._call_timeout_s = c.start_timeout_s, c.call_timeout_s
        self._stuck = False  # a call ran past its deadline: shutdown only kills the actor (anything else would queue)
        try:
            self._get(self._actor.ready.remote(), "start-up")
        except BaseException:
            ray.kill(self._actor, no_restart=True)
            raise
        self._generation = policy_generation
        policy_generation.delegate_rng(self)  # from now on the actor's generator is the live one
        self._closed = False

    def rollout_to_tq(self, input_batch: Any, **kwargs: Any) -> tuple[KVBatchMeta, dict[str, Any], dict[str, Any]]:
        """`SyncRolloutActor.rollout_to_tq` in the actor (its keywords, forwarded as they are); an environment
        override travels as its task names. Returns what it returns: `(meta, wire_carry, rollout_metrics)`."""
        override = kwargs.pop("task_to_env_override", None)
        if override is not None:
            kwargs["task_to_env_override_names"] = list(override)
        return self._get(self._actor.rollout.remote(input_batch, kwargs), "rollout")

    def record_step(self, meta: Any, request: Any, rows_from: Any = None) -> str:
        """`SyncRolloutActor.record_step` in the actor: the rows it holds and its store reads never reach the driver."""
        if rows_from is not None:
            raise ValueError("record_step(rows_from=...) joins two in-process actors; a Ray actor records its own rows")
        return self._get(self._actor.record_step.remote(meta, request), "record_step")

    def data_plane_metrics(self, reset: bool = False) -> dict[str, float]:
        return self._get(self._actor.data_plane_metrics.remote(reset), "data_plane_metrics")

    def export_flight(self, batches: list[tuple[str, list[str]]]) -> dict[str, Any]:
        """The flight recorder's rows of `(partition, keys)` batches this actor rolled out (`export_rows`): the
        asynchronous producer hands them to the trainer's actor, which records the step."""
        return self._get(self._actor.export_flight.remote(batches), "export_flight")

    def import_flight(self, saved: dict[str, Any]) -> None:
        """Rows `export_flight` returned, into this actor's stash (`import_rows`), for `record_step`."""
        self._get(self._actor.import_flight.remote(saved), "import_flight")

    def get_rng_state(self) -> torch.Tensor:
        return self._get(self._actor.get_rng_state.remote(), "get_rng_state")

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._get(self._actor.set_rng_state.remote(state), "set_rng_state")

    def _get(self, ref: Any, what: str) -> Any:
        """The call's result within `cluster.start_timeout_s` (start-up) or `cluster.call_timeout_s` (any other
        call); past it a TimeoutError names the call and the key."""
        from relayrl.distributed.ray_executor import death_site, get_within

        try:
            if what == "start-up":
                return get_within(ref, self._start_timeout_s, "the rollout actor's start-up", "cluster.start_timeout_s")
            return get_within(ref, self._call_timeout_s, f"the rollout actor's {what!r}", "cluster.call_timeout_s")
        except TimeoutError:
            self._stuck = True
            raise
        except self._ray.exceptions.RayActorError as exc:  # its process died (killed, OOM, its node lost)
            self._stuck = True  # nothing more to ask it: shutdown only makes sure it is gone
            raise ActorLostError(f"the rollout actor died during {what!r} ({death_site(exc)})") from None
        except self._ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, (EnvironmentClassError, RewardFunctionError)):  # the user's code: its one line,
                raise cause from None  # not Ray's trace around it
            raise

    def shutdown(self) -> bool:
        """Take the sampling stream back into the driver's engine, detach the actor from the store, stop it."""
        if self._closed:
            return True
        self._closed = True
        try:
            if not self._stuck:
                self._generation.delegate_rng(None)
                self._get(self._actor.shutdown.remote(), "shutdown")
        finally:
            with contextlib.suppress(Exception):  # already gone with its node or process
                self._ray.kill(self._actor, no_restart=True)
        return True


def ship_environments(task_to_env: dict[str, Any]) -> tuple[str, Any]:
    """The environments in the form the rollout actor rebuilds them from: the dict pickled whole (shared objects
    stay shared), else each one that pickles (environment classes: `ToolEnvironment.__getstate__`) and the task
    name of each that does not (built there from the registry)."""
    import ray

    try:
        return "pickled", ray.cloudpickle.dumps(task_to_env)
    except (TypeError, pickle.PicklingError, AttributeError):
        pass
    parts: dict[str, bytes | None] = {}
    for name, env in task_to_env.items():
        try:
            parts[name] = ray.cloudpickle.dumps(env)
        except (TypeError, pickle.PicklingError, AttributeError):
            parts[name] = None
    return "parts", parts


def receive_environments(envs: tuple[str, Any], cfg: MasterConfig) -> dict[str, Any]:
    """The environments `ship_environments` sent, in this process: unpickled, or built here from the registry by
    task name (environments holding locks or pools)."""
    kind, payload = envs
    if kind == "pickled":
        return dict(pickle.loads(payload))
    from relayrl.environments.registry import create_env

    return {
        name: pickle.loads(part) if part is not None else create_env(name, cfg.env) for name, part in payload.items()
    }


def check_environments_ship(task_to_env: dict[str, Any], timeout_s: float) -> None:
    """Refuse (ValueError, one line), before any model loads, an environment class the Ray rollout actor could not
    rebuild: one that does not pickle, or whose module (or `file.py`) a Ray worker cannot load. A Ray task unpickles
    each one the way the actor will."""
    import ray

    from relayrl.distributed.ray_executor import get_within

    payloads: dict[str, bytes] = {}
    for name, env in task_to_env.items():
        what = f"environment class {getattr(env, 'name', name)}"
        try:
            payloads[what] = ray.cloudpickle.dumps(env)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is the class's
            raise ValueError(f"{what} cannot be sent to the Ray rollout actor: {_line(exc)}; {_FIX}") from None
    check = ray.remote(num_cpus=0, max_retries=0)(_unpickle_problems)
    problems = get_within(
        check.remote(payloads), timeout_s, "the environment classes' check in a Ray worker", "cluster.start_timeout_s"
    )
    if problems:  # the first one (a run has one class, or a few from one module)
        what, problem = next(iter(problems.items()))
        raise ValueError(f"{what} cannot be rebuilt in the Ray rollout actor: {problem}; {_FIX}")


_FIX = (
    "define it at the top level of a module the Ray workers can import (the working directory or PYTHONPATH), "
    "name it as env.environment_factory=file.py:Class, or use cluster.executor=local"
)


def _unpickle_problems(payloads: dict[str, bytes]) -> dict[str, str]:
    """In a Ray worker: {name: one line} for each payload that does not unpickle there."""
    problems = {}
    for what, payload in payloads.items():
        try:
            pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as one line
            problems[what] = _line(exc)
    return problems


def _line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__

"""What a resume must check before it continues a run, so that it never silently becomes another run.

- The checkpoints: when a run directory holds checkpoints but none is intact, starting over from step 1 would throw
  the run away; it is refused unless asked for (`restart`), and then the damaged ones are moved aside, not deleted.
- The LR schedule: a cosine horizon taken from `max_num_steps` is fixed when the run starts and stored with every
  checkpoint (`GRPOSaveState.schedule_steps`); a resume with more (or fewer) steps continues that same schedule
  instead of re-stretching it mid-run.
- The training data: its size and a digest of its rendered prompts are stored with every checkpoint; a resume on a
  dataset that changed since is refused (the loader's position would point into other rows), or with
  `allow_inexact_resume` accepted when only the contents changed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.config import MasterConfig
from relayrl.utils.checkpoint import STATUS_FILE, CheckpointManager, GRPOSaveState, verify_checkpoint

DAMAGED_PREFIX = "damaged_"


def refuse_lost_checkpoints(checkpointer: CheckpointManager, restart: bool, log: Callable[[str], None]) -> None:
    """Called when no intact checkpoint was found: refuse to start over where checkpoints existed (ValueError, one
    line), or with `restart` move the damaged ones to `damaged_step_N` and let the run start from step 1."""
    ckpt_dir = checkpointer.checkpoint_dir
    damaged = checkpointer.list_checkpoints()
    if not damaged and not (ckpt_dir / STATUS_FILE).is_file():
        return  # a new run, or one that never saved a checkpoint
    if not restart:
        what = (
            f"its {len(damaged)} checkpoint(s) are all damaged or incomplete (step_{max(damaged)}: "
            f"{verify_checkpoint(damaged[max(damaged)])})"
            if damaged
            else f"its checkpoints are gone ({STATUS_FILE} records step {_recorded_step(ckpt_dir)})"
        )
        raise ValueError(
            f"{ckpt_dir}: {what}; refusing to start the run over: pass --restart to train it again from step 1 "
            "(damaged checkpoints are kept as damaged_step_N), or restore a checkpoint"
        )
    for step, path in damaged.items():
        aside = path.with_name(f"{DAMAGED_PREFIX}{path.name}")
        if aside.exists():
            aside = path.with_name(f"{DAMAGED_PREFIX}{path.name}_{os.getpid()}")
        os.replace(path, aside)
        log(f"relayrl: --restart: moved the damaged checkpoint step_{step} to {aside}")
    (ckpt_dir / STATUS_FILE).unlink(missing_ok=True)


def _recorded_step(ckpt_dir: Path) -> object:
    import json

    try:
        return json.loads((ckpt_dir / STATUS_FILE).read_text()).get("last_checkpoint_step", "?")
    except (OSError, ValueError, AttributeError):
        return "?"


def schedule_config(cfg: MasterConfig, state: GRPOSaveState, log: Callable[[str], None]) -> MasterConfig:
    """The config to build the policy (and critic) with: `cfg`, except that an LR horizon derived from
    `max_num_steps` keeps the value the run started with. Records that value in `state` for later checkpoints."""
    block = cfg.algorithm
    steps = cfg.rollout.max_num_steps
    if state.schedule_steps is None:  # a new run (or a checkpoint from before horizons were stored)
        state.schedule_steps = steps
        return cfg
    if state.schedule_steps == steps:
        return cfg
    derived = [
        name
        for name, sched in (("policy", cfg.policy.scheduler), ("value", cfg.value.scheduler))
        if sched.name == "cosine" and sched.decay_steps is None and (name == "policy" or block == "ppo")
    ]
    if derived:
        log(
            f"relayrl: {block}.max_num_steps {state.schedule_steps} -> {steps}: the cosine LR schedule of "
            f"{' and '.join(derived)} keeps the horizon it started with ({block}.max_num_steps={state.schedule_steps}"
            "; past it the LR stays at min_lr_ratio); set scheduler.decay_steps in a new run for a longer decay"
        )
    rollout = cfg.rollout.model_copy(update={"max_num_steps": state.schedule_steps})
    return cfg.model_copy(update={block: rollout})


def dataset_digest(dataset: Any) -> tuple[int, str]:
    """(rows, sha256 of every row's rendered prompt, task and answer, in order) of a `PromptDataset`."""
    digest = hashlib.sha256()
    for item in dataset.fingerprint_items():
        digest.update(item.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return len(dataset), digest.hexdigest()


def check_dataset(dataset: Any, state: GRPOSaveState, last: Path | None, allow_inexact: bool) -> None:
    """Refuse (ValueError, one line) a resume whose training set differs from the checkpoint's; then record this
    one in `state` for the checkpoints to come."""
    rows, digest = dataset_digest(dataset)
    if last is not None and state.train_rows is not None:
        if state.train_rows != rows:
            raise ValueError(
                f"the training set has {rows} prompts but checkpoint {last} was taken on {state.train_rows}: the "
                "data changed since (data.train.path, its file, or the filters), so the resumed run cannot continue "
                "its epoch; resume with the same data, or start a new run directory"
            )
        if state.train_data_sha256 not in (None, digest) and not allow_inexact:
            raise ValueError(
                f"the training set's prompts changed since checkpoint {last} (same {rows} rows, other contents): "
                "the resumed run would train on other data than the run it continues; restore the data, pass "
                "--allow-inexact-resume to resume on the new data anyway, or start a new run directory"
            )
    state.train_rows, state.train_data_sha256 = rows, digest

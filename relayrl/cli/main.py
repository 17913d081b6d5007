"""`relayrl` command line: train (GRPO or PPO), evaluate, parity, plot, config show, export, replay, diff, inspect.

Bad input (config keys and values, missing paths, unusable datasets) ends with one line on stderr and exit code 2,
never a traceback; heavy imports happen only after the arguments and the config are known to be good.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from relayrl.cli import diff as diff_cli
from relayrl.cli import export as export_cli
from relayrl.cli import export_rollouts as export_rollouts_cli
from relayrl.cli import inspect_run as inspect_cli
from relayrl.cli import replay as replay_cli
from relayrl.config import MasterConfig
from relayrl.utils.config_io import ConfigError, check_recorded_config, classify_resume_changes, load_config

USER_ERRORS = (ConfigError, FileNotFoundError, NotADirectoryError, ValueError, KeyError)
EXIT_USAGE = 2
FORCED_EXIT_S = 5.0  # after a second Ctrl-C, the longest clean-up before the process exits regardless


def _fail(message: str) -> int:
    print(f"relayrl: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _ray_in_use() -> bool:
    ray = sys.modules.get("ray")  # never imported here: the local path has no Ray
    return ray is not None and bool(ray.is_initialized())


def _last_line(text: str, leave_ray: bool) -> None:
    """A run's closing line on stderr. With `leave_ray` (the run itself joined or started Ray, not its caller) the
    driver leaves Ray first, so the line is the last one printed (nothing Ray streams from the cluster follows it)."""
    if leave_ray:
        from relayrl.distributed.errors import leave_ray_quietly

        leave_ray_quietly()
    print(text, file=sys.stderr)


def _run_failed(line: str, leave_ray: bool) -> int:
    """A run that failed mid-way: its one line, last, and exit 1."""
    _last_line(f"relayrl: error: {line}", leave_ray)
    return 1


def _resume_command(cfg: MasterConfig, run_dir: Path) -> str:
    """The command that resumes this run: a driver that joined its Ray cluster through `RAY_ADDRESS` (not a
    recorded `cluster.ray_address`) needs the same address to find the cluster again."""
    uses_ray = cfg.cluster.executor == "ray" or cfg.data_plane.backend != "memory"
    address = os.environ.get("RAY_ADDRESS") if uses_ray and not cfg.cluster.ray_address else None
    return f"{f'RAY_ADDRESS={address} ' if address else ''}relayrl train --run-dir {run_dir}"


def _parser() -> argparse.ArgumentParser:
    import relayrl

    p = argparse.ArgumentParser(prog="relayrl", description="RL post-training of language models (GRPO and PPO).")
    p.add_argument("--version", action="version", version=f"relayrl {relayrl.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train",
        help="train with GRPO or PPO (algorithm=ppo, e.g. configs/ppo_arith_tiny.yaml); the embedded default trains "
        "the shipped model on arithmetic with GRPO",
    )
    t.add_argument("--config", help="YAML config (see configs/); defaults are the embedded default run")
    t.add_argument("--run-dir", help="run directory; an existing one resumes (default: a new runs/NNN)")
    t.add_argument(
        "--allow-inexact-resume",
        action="store_true",
        help="resume a run whose config changed in a way that breaks exactness (model, data, batch shape, seed, ...)",
    )
    t.add_argument(
        "--restart",
        action="store_true",
        help="train the run again from step 1 when none of its checkpoints is intact (instead of refusing)",
    )
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.num_prompts_per_step=8")

    e = sub.add_parser("evaluate", help="validation accuracy of a checkpoint (step_N dir or HF model dir)")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--config", help="config to evaluate with (default: the checkpoint's own config.yaml)")
    e.add_argument("overrides", nargs="*")

    pa = sub.add_parser(
        "parity", help="run the legacy and the data-plane trainer (GRPO or PPO) on one config; compare metrics"
    )
    pa.add_argument("--config", help="YAML config (default: the embedded default run)")
    pa.add_argument("--steps", type=int, default=5, help="training steps per trainer (default 5)")
    pa.add_argument("--tolerance", type=float, default=0.0, help="largest allowed |difference| (default 0: exact)")
    pa.add_argument("--out", help="directory for both runs (default: a new runs/NNN)")
    pa.add_argument(
        "--async",
        dest="async_grpo",
        action="store_true",
        help="compare the data-plane trainer with async GRPO at max_trajectory_age_steps=0 instead (GRPO only)",
    )
    pa.add_argument("overrides", nargs="*")

    pl = sub.add_parser(
        "plot",
        help="PNG of reward, accuracy, KL, loss, length and step time vs step (with environment classes: tool-call "
        "validity, turns per episode, tool latency), and each step's time by phase",
    )
    pl.add_argument("run_dir")
    pl.add_argument("--out", help="output PNG (default: RUN_DIR/metrics.png)")
    pl.add_argument("--breakdown", action="store_true", help="only the stacked chart of each step's time by phase")
    for command in (replay_cli, diff_cli, inspect_cli, export_cli, export_rollouts_cli):  # each adds parser, handler
        command.add_parser(sub)

    c = sub.add_parser("config", help="show the resolved config (GRPO or PPO) with every field's description")
    csub = c.add_subparsers(dest="config_command", required=True)
    cs = csub.add_parser("show", help="print the resolved config as YAML, each field under its description")
    cs.add_argument("--config", help="YAML config (default: the embedded default run)")
    cs.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm=ppo")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # Idle OpenMP threads sleep instead of spinning: with several threads on a shared machine, spinning turns a
    # second of work into several (must be set before torch is imported).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = _parser().parse_args(argv)
    if hasattr(args, "handler"):
        return int(args.handler(args))
    if args.command == "train":
        return _train(args)
    if args.command == "evaluate":
        return _evaluate(args)
    if args.command == "parity":
        return _parity(args)
    if args.command == "config":
        return _config_show(args)
    return _plot(args)


def _config_show(args: argparse.Namespace) -> int:
    """The resolved config with its descriptions; a config in NeMo RL's layout is preceded by what relayrl does with
    each of its keys (mapped, not used, refused), every refused key named even though loading stops at the first."""
    from relayrl.config.nemo_show import classify_keys, format_classification
    from relayrl.utils import config_io

    try:
        raw = config_io._read_yaml(Path(args.config)) if args.config else {}
        for item in args.overrides:
            config_io.set_override(raw, *config_io.parse_override(item))
    except ConfigError as exc:
        return _fail(str(exc))
    rows, nemo = classify_keys(raw, config_io.validate_config)
    if nemo:
        sys.stdout.write(format_classification(rows))
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        return _fail(str(exc))
    sys.stdout.write(config_io.describe_config(cfg))
    return 0


def _train(args: argparse.Namespace) -> int:
    from relayrl.utils.paths import next_run_dir

    run_dir = Path(args.run_dir) if args.run_dir else None
    recorded = run_dir / "config.yaml" if run_dir is not None else None
    resuming = recorded is not None and recorded.is_file()
    try:  # resuming: the run's own resolved config (unless --config names another), plus this command's overrides
        if run_dir is not None and not args.config:  # missing, unreadable or truncated: one line, never defaults
            check_recorded_config(run_dir, args.overrides)
        cfg = load_config(recorded if resuming and not args.config else args.config, args.overrides)
        base = load_config(recorded) if resuming else None
    except ConfigError as exc:
        return _fail(str(exc))
    from relayrl.utils.dir_lock import DirectoryInUseError, lock_run_directories

    ckpt_dir = cfg.checkpointing.checkpoint_dir or (run_dir / "checkpoints" if run_dir is not None else None)
    try:  # another live run there: say so first. Held until this command ends; set-up shares the hold
        _held = lock_run_directories(run_dir, ckpt_dir, create=False)
    except DirectoryInUseError as exc:
        return _fail(str(exc))
    except OSError as exc:  # a read-only run directory: nothing can be written there
        return _fail(f"cannot write in {exc.filename or run_dir}: {exc.strerror or exc}")
    fresh = run_dir is None
    if run_dir is None:
        run_dir = next_run_dir(cfg.logger.log_dir)
    elif base is not None:
        problem = _check_resume(base, cfg, run_dir, args.allow_inexact_resume)
        if problem:
            return _fail(problem)
    from relayrl.algorithms.async_rollouts import ProducerDiedError
    from relayrl.algorithms.logprob_error import LogprobErrorAlarm
    from relayrl.algorithms.runner import CheckpointIncompleteError, CheckpointWriteError
    from relayrl.algorithms.setup import ResumeOptions, SetupError, run_training
    from relayrl.algorithms.trainer_common import NonFiniteError
    from relayrl.data_plane.interfaces import ChecksumMismatchError, DataPlaneClosedError
    from relayrl.distributed.errors import ActorLostError, WorkerDiedError
    from relayrl.distributed.refit_digest import RefitVerificationError
    from relayrl.environments.reward_fn_env import RewardFunctionError
    from relayrl.environments.tool_env import EnvironmentClassError
    from relayrl.utils.deadlines import DeadlineError, deadline_line
    from relayrl.utils.signals import TrainingInterrupted, exit_code, set_forced_exit_deadline

    resume = f"`{_resume_command(cfg, run_dir)}` resumes from the last checkpoint"
    leave_ray = not _ray_in_use()  # a caller's own Ray stays connected
    failed = functools.partial(_run_failed, leave_ray=leave_ray)
    set_forced_exit_deadline(FORCED_EXIT_S, resume)  # a second Ctrl-C ends this process within seconds, whatever hangs
    try:
        options = ResumeOptions(restart=args.restart, allow_inexact=args.allow_inexact_resume)
        summary = run_training(cfg, run_dir, new_run_dir=fresh, announce=True, resume=options)
    except SetupError as exc:
        return _fail(str(exc))
    except RewardFunctionError as exc:  # the user's reward function: one line naming it and the row
        text = str(exc)  # raised in a Ray actor: Ray's wrapper adds the remote traceback around our line
        line = next((ln.strip() for ln in text.splitlines() if "reward function '" in ln), text.strip())
        return failed(f"{line[line.find('reward function') :]}; {resume}")
    except EnvironmentClassError as exc:  # the user's environment class: one line naming it and the row
        return failed(f"{str(exc).strip().splitlines()[0]}; {resume}")
    except TrainingInterrupted as exc:  # SIGINT / SIGTERM: the step finished and was checkpointed
        _last_line(f"relayrl: {exc}; `{_resume_command(cfg, run_dir)}` resumes", leave_ray)
        return exit_code(exc.signum)
    except KeyboardInterrupt:  # a second Ctrl-C: out at once
        print(f"relayrl: interrupted; {resume}", file=sys.stderr)
        return exit_code(2)
    except CheckpointWriteError as exc:  # disk full, read-only: the previous checkpoint is intact
        return failed(f"{exc}; {resume}")
    except (NonFiniteError, RefitVerificationError, LogprobErrorAlarm) as exc:  # caught in the step; one line
        return failed(f"{exc}; {resume}")
    except DeadlineError as exc:  # a blocking call past its deadline (the message names it and the key)
        return failed(f"{deadline_line(exc)}; {resume}")
    except CheckpointIncompleteError as exc:  # not published: the previous checkpoint is still the resume point
        return failed(f"{exc}; {resume}")
    except ChecksumMismatchError as exc:  # a data-plane row changed after its put: names key and field
        return failed(f"{str(exc).strip().splitlines()[0]}; {resume}")
    except (ActorLostError, DataPlaneClosedError) as exc:  # a Ray actor of the run died (the store, the rollouts)
        return failed(f"{str(exc).strip().splitlines()[0]}; {resume}")
    except ProducerDiedError as exc:  # async GRPO's rollout producer raised: one line, and how to continue
        return failed(f"{exc}; {resume}")
    except WorkerDiedError as exc:  # not the user's input: exit 1, and say how to continue
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]  # raised in an actor: + its trace
        found = [ln[ln.index("rank ") :] for ln in lines if "rank " in ln and " died" in ln]
        reason = found[-1] if found else (lines[0] if lines else type(exc).__name__)
        return failed(f"{reason}; {resume}")
    except OSError as exc:  # a run directory that became unwritable (disk full, read-only): where, and why
        where = f"{exc.filename}: " if exc.filename else ""
        return failed(f"cannot write {where}{exc.strerror or exc}; {resume}")
    _print_summary(summary)
    return 0


def _check_resume(recorded: MasterConfig, cfg: MasterConfig, run_dir: Path, allow_inexact: bool) -> str | None:
    """Changes against the config a run was checkpointed with: safe ones are printed and applied; ones that break
    exactness need --allow-inexact-resume; optimizer/scheduler changes are refused (the checkpoint's optimizer and
    scheduler state would overwrite them). Returns the one-line refusal, or None."""
    if not any(_checkpoint_dir(cfg, run_dir).glob("step_*")):
        return None  # nothing to resume from: the run starts over with the new config
    safe, inexact, restored = classify_resume_changes(recorded, cfg)
    if restored:
        key, old, new = restored[0]
        return (
            f"{key} cannot change when resuming ({old!r} -> {new!r}): the checkpoint's optimizer and scheduler "
            "state would overwrite it; resume without the change or start a new run directory"
        )
    for key, old, new in inexact:
        if key == "policy.lora.enabled":  # adapters vs full weights: no flag makes that checkpoint loadable
            held = "LoRA adapters" if old else "full weights"
            return f"{key} cannot change when resuming ({old!r} -> {new!r}): {run_dir}'s checkpoints hold {held}"
    if inexact and not allow_inexact:
        key, old, new = inexact[0]
        more = f" (and {len(inexact) - 1} more)" if len(inexact) > 1 else ""
        return (
            f"{key} changed since {run_dir} was checkpointed ({old!r} -> {new!r}){more}: the resumed run would no "
            "longer match an uninterrupted one; pass --allow-inexact-resume to resume anyway, or use a new run directory"
        )
    for key, old, new in safe + inexact:
        print(f"relayrl: resuming with {key}: {old!r} -> {new!r}", file=sys.stderr)
    return None


def _checkpoint_dir(cfg: MasterConfig, run_dir: Path) -> Path:
    return Path(cfg.checkpointing.checkpoint_dir) if cfg.checkpointing.checkpoint_dir else run_dir / "checkpoints"


def _print_summary(summary: dict) -> None:
    print(f"run directory: {summary['run_dir']}")
    if "first_validation" in summary:
        f, last = summary["first_validation"], summary["last_validation"]
        print(
            f"validation accuracy: step {f['step']}: {f['accuracy']:.3f} -> step {last['step']}: "
            f"{last['accuracy']:.3f} ({summary['accuracy_gain_points']:+.1f} points)"
        )


def _evaluate(args: argparse.Namespace) -> int:
    from relayrl.utils.checkpoint import MANIFEST
    from relayrl.utils.checkpoint_read import read_checkpoint
    from relayrl.utils.state_file import CheckpointError

    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        return _fail(f"checkpoint directory does not exist: {ckpt}")
    try:  # a run's step_N: read through its verified, stable view (a live run may prune it); else a model directory
        with read_checkpoint(ckpt) if (ckpt / MANIFEST).is_file() else contextlib.nullcontext(ckpt) as view:
            return _evaluate_dir(args, ckpt, view)
    except CheckpointError as exc:
        return _fail(str(exc))


def _evaluate_dir(args: argparse.Namespace, ckpt: Path, view: Path) -> int:
    try:
        config_path = args.config or (view / "config.yaml" if (view / "config.yaml").is_file() else None)
        cfg = load_config(config_path, args.overrides)
    except ConfigError as exc:
        return _fail(str(exc))
    from relayrl.algorithms.evaluate import evaluate_checkpoint
    from relayrl.algorithms.setup import weights_error

    try:
        metrics = evaluate_checkpoint(cfg, view)
    except USER_ERRORS as exc:
        return _fail(str(exc).strip("'\""))
    except Exception as exc:  # unreadable weights (a truncated model directory): one line naming it
        if (err := weights_error("--checkpoint", str(ckpt), exc)) is exc:
            raise
        return _fail(str(err))
    metrics["checkpoint"] = str(ckpt)
    print(json.dumps(metrics))
    return 0


def _parity(args: argparse.Namespace) -> int:
    from relayrl.utils.paths import next_run_dir

    if args.steps < 1:
        return _fail(f"--steps must be >= 1, got {args.steps}")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        return _fail(str(exc))
    from relayrl.algorithms.parity import run_parity
    from relayrl.algorithms.setup import SetupError

    out = Path(args.out) if args.out else next_run_dir(cfg.logger.log_dir)
    try:
        report = run_parity(cfg, out, steps=args.steps, async_grpo=args.async_grpo)
    except SetupError as exc:
        return _fail(str(exc))
    worst = sorted(report["max_abs_diff"].items(), key=lambda kv: -kv[1])
    width = max((len(k) for k, _ in worst), default=10)
    print(f"parity over steps {report['steps']} ({len(worst)} metrics; runs in {out}):")
    for name, diff in worst:
        flag = "" if diff <= args.tolerance else "   <-- beyond tolerance"
        print(f"  {name:<{width}}  {diff:.3g}{flag}")
    for line in report["missing"]:
        print(f"  MISSING: {line}")
    failed = [k for k, d in worst if d > args.tolerance] + report["missing"]
    print(f"parity {'FAILED' if failed else 'OK'} (tolerance {args.tolerance:g})")
    return 1 if failed else 0


def _plot(args: argparse.Namespace) -> int:
    from relayrl.utils.plot import plot_run

    try:
        out = plot_run(Path(args.run_dir), Path(args.out) if args.out else None, breakdown_only=args.breakdown)
    except (FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # a read-only run directory, a full disk: where it could not write, and the way out
        return _fail(
            f"cannot write {exc.filename or args.out}: {exc.strerror or exc}; pass --out PATH to write elsewhere"
        )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

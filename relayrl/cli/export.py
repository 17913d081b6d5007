"""`relayrl export RUN_DIR [--step N] --out DIR [--adapters] [--push-to-hub REPO]`: a checkpoint as one Hugging Face
directory that `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load.

The directory holds the policy's weights as safetensors (`config.json`, `model.safetensors`), its tokenizer (chat
template included) and a `generation_config.json` with the run's sampling settings. A LoRA run is exported merged
(base weights + B @ A * alpha / rank: exactly what its generation engine ran on) unless `--adapters`, which writes
the `peft` adapter directory instead, its `base_model_name_or_path` pointing at the base model.

Checkpoints are read, never locked or changed: a live run may keep training (and pruning) while one of its
checkpoints is exported, which is read through verified hard links (`relayrl.utils.checkpoint_read`).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relayrl.utils.checkpoint import RUN_CONFIG
from relayrl.utils.checkpoint_read import published_steps, read_checkpoint, read_latest_checkpoint
from relayrl.utils.state_file import CheckpointError

EXIT_USAGE = 2


class ExportError(CheckpointError):
    """Input that cannot be exported (no run, no complete checkpoint, bad --out); one line."""


def add_parser(sub: Any) -> None:
    """Register `export` on the CLI's sub-command parsers."""
    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory (LoRA merged)")
    ex.add_argument("run_dir", help="run directory (or one of its checkpoints/step_N)")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    ex.add_argument("--out", required=True, help="output directory (new or empty)")
    ex.add_argument("--adapters", action="store_true", help="LoRA run: write the peft adapters instead of merging")
    ex.add_argument("--push-to-hub", metavar="REPO", help="upload the directory to this Hugging Face Hub repo")
    ex.set_defaults(handler=run)


@contextlib.contextmanager
def open_checkpoint(run_dir: Path, step: int | None = None) -> Iterator[tuple[Path, Path]]:
    """(published path, verified stable view) of `run_dir`'s checkpoint at `step` (default: the newest intact one;
    `run_dir` may be a step_N itself); see `relayrl.utils.checkpoint_read`. ExportError naming the damaged file."""
    if not run_dir.is_dir():
        raise ExportError(f"run directory does not exist: {run_dir}")
    if (run_dir / "manifest.json").is_file():  # a step_N directory itself
        if step is not None:
            raise ExportError(f"{run_dir} is one checkpoint already; --step applies to a run directory")
        with _refused(), read_checkpoint(run_dir) as view:
            yield run_dir, view
        return
    ckpt_dir = _checkpoint_dir(run_dir)
    if step is not None:
        steps = published_steps(ckpt_dir)
        if step not in steps:
            have = ", ".join(str(s) for s in sorted(steps)) or "none"
            raise ExportError(f"{ckpt_dir} has no step_{step} (checkpoints: {have}); pick one with --step")
        with _refused(), read_checkpoint(ckpt_dir / f"step_{step}") as view:
            yield ckpt_dir / f"step_{step}", view
        return
    skipped: list[str] = []
    with _refused(), read_latest_checkpoint(ckpt_dir, skipped) as view:
        for line in skipped:
            print(f"relayrl: {line}", file=sys.stderr)
        yield ckpt_dir / view.name, view


@contextlib.contextmanager
def _refused() -> Iterator[None]:
    try:
        yield
    except CheckpointError as exc:
        if isinstance(exc, ExportError):
            raise
        raise ExportError(str(exc)) from None


def _checkpoint_dir(run_dir: Path) -> Path:
    """checkpointing.checkpoint_dir of the run's config.yaml, else RUN_DIR/checkpoints."""
    import yaml

    config = run_dir / RUN_CONFIG
    if config.is_file():
        recorded = (yaml.safe_load(config.read_text()) or {}).get("checkpointing", {}) or {}
        if recorded.get("checkpoint_dir"):
            return Path(recorded["checkpoint_dir"])
    return run_dir / "checkpoints"


def export_checkpoint(run_dir: Path, out: Path, *, step: int | None = None, adapters: bool = False) -> Path:
    """Write the checkpoint (see `find_checkpoint`) as a Hugging Face directory at `out`; returns the checkpoint."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory; choose a new one")
    with open_checkpoint(run_dir, step) as (published, checkpoint):
        _export(checkpoint, out, adapters)
    return published


def _export(checkpoint: Path, out: Path, adapters: bool) -> None:
    """Write the (verified, stable) checkpoint directory `checkpoint` as a Hugging Face directory at `out`."""
    from relayrl.utils.config_io import ConfigError, load_config

    config_file = checkpoint / RUN_CONFIG
    if not config_file.is_file():
        raise ExportError(f"checkpoint {checkpoint} has no {RUN_CONFIG}; it was not written by `relayrl train`")
    try:
        cfg = load_config(config_file)
    except ConfigError as exc:
        raise ExportError(f"{config_file}: {exc}") from None
    weights = checkpoint / "policy" / "weights"
    from relayrl.models.policy import lora

    is_lora = lora.is_adapter_dir(weights)
    if adapters and not is_lora:
        raise ExportError(
            f"--adapters needs a LoRA run; {checkpoint} holds full weights (export it without --adapters)"
        )
    if is_lora and cfg.policy.random_init:
        raise ExportError(f"{checkpoint}: LoRA on a random_init base model cannot be exported (no base weights exist)")
    tokenizer = _tokenizer(checkpoint, cfg)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if adapters:
            _write_adapters(weights, out, cfg)
        else:
            model = _merged_model(cfg, weights) if is_lora else _full_model(weights)
            model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
        _generation_config(cfg, tokenizer).save_pretrained(str(out))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _tokenizer(checkpoint: Path, cfg: Any) -> Any:
    from transformers import AutoTokenizer

    from relayrl.utils.paths import resolve_tokenizer_path

    saved = checkpoint / "policy" / "tokenizer"
    source = saved if saved.is_dir() else resolve_tokenizer_path(cfg.policy.tokenizer.name or cfg.policy.model_name)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _full_model(weights: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(weights), dtype="auto")


def _merged_model(cfg: Any, weights: Path) -> Any:
    """The base model with the checkpoint's adapters merged in, as a plain Hugging Face module (no peft layers)."""
    from relayrl.models.policy import lora
    from relayrl.models.policy.worker import load_causal_lm

    adapted = load_causal_lm(cfg.policy)
    peft_model = lora.add_adapters(adapted, cfg.policy)
    lora.load_adapters(peft_model, weights)
    plain = load_causal_lm(cfg.policy)
    live = plain.state_dict()
    for name, tensor in lora.merged_named_tensors(adapted):
        live[name].copy_(tensor)
    return plain


def _write_adapters(weights: Path, out: Path, cfg: Any) -> None:
    """The peft adapter directory, its base model named by absolute path (so peft finds it offline)."""
    import json

    from relayrl.models.policy import lora
    from relayrl.utils.paths import resolve_model_path

    shutil.copyfile(weights / lora.ADAPTER_WEIGHTS, out / lora.ADAPTER_WEIGHTS)
    adapter_config = json.loads((weights / lora.ADAPTER_CONFIG).read_text())
    adapter_config["base_model_name_or_path"] = str(resolve_model_path(cfg.policy.model_name).resolve())
    (out / lora.ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")


def _generation_config(cfg: Any, tokenizer: Any) -> Any:
    """The run's sampling settings as a transformers GenerationConfig."""
    from transformers import GenerationConfig

    gen = cfg.policy.generation
    stop = gen.stop_token_ids if gen.stop_token_ids is not None else [tokenizer.eos_token_id]
    return GenerationConfig(
        do_sample=True,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k or 0,
        max_new_tokens=gen.max_new_tokens,
        eos_token_id=stop[0] if len(stop) == 1 else stop,
        pad_token_id=tokenizer.pad_token_id,
        stop_strings=gen.stop_strings,
    )


def push_to_hub(out: Path, repo: str) -> str:
    """Upload `out` to the Hub repo `repo` (created if missing); returns its URL. ExportError when offline."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(folder_path=str(out), repo_id=repo, commit_message="relayrl export")
    except Exception as exc:  # noqa: BLE001 - network, auth or permission: one line, the export itself is done
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"cannot push to {repo}: {first}; {out} is written") from None
    return f"https://huggingface.co/{repo}"


def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (HF_HUB_OFFLINE=1): nothing can be pushed."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def run(args: argparse.Namespace) -> int:
    """The `export` command: exit 0; 2 with one line on stderr for bad input; 1 when the upload fails."""
    out = Path(args.out)
    if args.push_to_hub and hub_offline():
        print(
            f"relayrl: error: cannot push to {args.push_to_hub}: the Hugging Face Hub is offline "
            "(HF_HUB_OFFLINE=1); unset it, or export without --push-to-hub",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per outcome, no loading bars
    try:
        checkpoint = export_checkpoint(Path(args.run_dir), out, step=args.step, adapters=args.adapters)
    except (ExportError, FileNotFoundError, ValueError) as exc:
        print(f"relayrl: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # --out on a read-only or full file system: where, and why
        print(f"relayrl: error: cannot write {exc.filename or out}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    kind = "LoRA adapters" if args.adapters else "model"
    print(f"exported {checkpoint} as a Hugging Face {kind} directory: {out}")
    if args.push_to_hub:
        try:
            print(f"pushed to {push_to_hub(out, args.push_to_hub)}")
        except ExportError as exc:
            print(f"relayrl: error: {exc}", file=sys.stderr)
            return 1
    return 0

"""Checks that need more than the config schema (the machine, the model's files, the tokenizer, the data) and run
before any model is loaded, so a mistake costs a second and one line, not a traceback after minutes of loading.

Each check raises `ValueError` with one line naming the key and the fix; `setup` turns it into the CLI's exit 2.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from relayrl.algorithms.protocols import Tokenizer
from relayrl.config import MasterConfig
from relayrl.utils.paths import resolve_model_path

__all__ = ["check_machine", "check_model_and_tokenizer", "check_task_environments", "read_chat_template"]

#: Optional packages a logger backend needs: config key -> (import name, pip extra).
_LOGGER_PACKAGES = {"wandb_enabled": ("wandb", "wandb"), "mlflow_enabled": ("mlflow", "mlflow")}


def check_machine(cfg: MasterConfig) -> None:
    """The devices and optional packages the config asks for exist here."""
    import torch

    wants_cuda = cfg.cluster.device == "cuda" or (
        cfg.env.reward_model is not None and cfg.env.reward_model.device.startswith("cuda")
    )
    if wants_cuda and not torch.cuda.is_available():
        key = "cluster.device" if cfg.cluster.device == "cuda" else "env.reward_model.device"
        raise ValueError(
            f"{key} asks for CUDA but torch sees no CUDA device here; set {key}=cpu (or cluster.device=auto)"
        )
    wanted = [("cluster.executor=ray", "ray", "ray")] if cfg.cluster.executor == "ray" else []
    if cfg.cluster.executor == "ray":
        wanted.append(("cluster.executor=ray", "zmq", "ray"))  # pyzmq: the weight refit
    if cfg.data_plane.enabled and cfg.data_plane.backend == "transfer_queue":
        wanted.append(("data_plane.backend=transfer_queue", "transfer_queue", "transfer_queue"))
    for setting, module, extra in wanted:
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"{setting} needs the {module} package, which is not installed: pip install 'relayrl[{extra}]'"
            )
    for key, (module, extra) in _LOGGER_PACKAGES.items():
        if getattr(cfg.logger, key) and importlib.util.find_spec(module) is None:
            raise ValueError(
                f"logger.{key}=true needs the {module} package, which is not installed: "
                f"pip install 'relayrl[{extra}]' or set logger.{key}=false"
            )
    if cfg.policy.lora.enabled:
        from relayrl.models.policy.lora import peft_missing_message

        if (problem := peft_missing_message()) is not None:
            raise ValueError(problem)


def read_chat_template(value: str) -> str:
    """`policy.tokenizer.chat_template` is Jinja text or the path of a `.jinja` file; a path that does not exist is
    an error (it must never become the template text), and the template must compile."""
    looks_like_path = value.endswith((".jinja", ".j2", ".jinja2")) or ("{" not in value and "/" in value)
    if looks_like_path:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"policy.tokenizer.chat_template file does not exist: {path}")
        value = path.read_text()
    import jinja2

    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"policy.tokenizer.chat_template has a Jinja syntax error on line {exc.lineno}: {exc.message}"
        ) from None
    return value


def check_model_and_tokenizer(cfg: MasterConfig, tokenizer: Tokenizer) -> None:
    """Sequence lengths against the model's position limit, token ids against the vocabulary, from the model's
    config.json alone (no weights are read)."""
    from transformers import AutoConfig

    source = resolve_model_path(cfg.policy.model_name)
    try:
        model_cfg = AutoConfig.from_pretrained(str(source)).get_text_config()
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"policy.model_name {source} has no usable config.json: {first}") from None
    limit = getattr(model_cfg, "max_position_embeddings", None)
    length = cfg.policy.max_total_sequence_length
    if isinstance(limit, int) and length > limit:
        raise ValueError(
            f"policy.max_total_sequence_length = {length} exceeds the model's position limit "
            f"(max_position_embeddings = {limit}); set it to at most {limit}"
        )
    vocab = max(int(getattr(model_cfg, "vocab_size", 0) or 0), len(tokenizer))
    bad = [t for t in cfg.policy.generation.stop_token_ids or [] if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"policy.generation.stop_token_ids {bad} are outside the vocabulary (ids 0..{vocab - 1}); "
            "use ids of the policy tokenizer"
        )


def check_task_environments(task_names: list[str], classes: list[str] | None = None) -> None:
    """Every task a dataset row names has a registered environment or environment class (`classes`: their task
    names), else its rows could never be scored."""
    from relayrl.environments.registry import ENV_REGISTRY

    known = set(ENV_REGISTRY) | set(classes or [])
    missing = sorted({name for name in task_names if name not in known})
    if missing:
        raise ValueError(
            f"the dataset names task(s) {', '.join(map(repr, missing))} with no environment; registered: "
            f"{', '.join(sorted(known))} (set data.*.default_task or the rows' task field, or register_env)"
        )

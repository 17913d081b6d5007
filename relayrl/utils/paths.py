"""Where things live: the shipped model, Hugging Face Hub models (through the local cache), run directories."""

from __future__ import annotations

import os
import re
from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
_BUILTIN_PREFIX = "builtin:"
#: `org/name` as the Hub spells repository ids (one slash; letters, digits, `-`, `_`, `.`).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
#: The files a causal LM and its tokenizer need; a download skips the rest (other weight formats, images, ...).
_MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]


def resolve_tokenizer_path(name: str) -> Path:
    """Like resolve_model_path, but a directory holding only tokenizer files (no config.json) is accepted."""
    if name.startswith(_BUILTIN_PREFIX):
        return resolve_model_path(name)
    path = Path(name).expanduser()
    if path.is_dir() and ((path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()):
        return path
    return resolve_model_path(name)


def resolve_model_path(name: str) -> Path:
    """Map `builtin:<name>` to the copy shipped inside the package, a Hub id (`org/name`, when no such local
    directory exists) to its snapshot in the Hugging Face cache, anything else to a local directory.

    Raises FileNotFoundError / NotADirectoryError naming the path, so a typo fails before any model code runs.
    """
    if name.startswith(_BUILTIN_PREFIX):
        path = _ASSETS / name[len(_BUILTIN_PREFIX) :]
        if not path.is_dir():
            available = sorted(p.name for p in _ASSETS.iterdir() if p.is_dir()) if _ASSETS.is_dir() else []
            raise FileNotFoundError(f"no built-in model {name!r}; available: {', '.join(available) or 'none'}")
        return path
    path = Path(name).expanduser()
    if not path.exists() and _REPO_ID.fullmatch(name):
        path = hub_snapshot(name)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"model path is not a directory: {path}")
    if not (path / "config.json").is_file():
        raise ValueError(f"not a Hugging Face model directory (no config.json): {path}")
    return path


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, but read now (the library reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of a Hub model: from the cache (HF_HUB_CACHE), downloaded into it first when online.
    Offline and not cached, or not on the Hub, is one line saying so."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    offline = hub_offline()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=offline, allow_patterns=_MODEL_FILES))
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local directory nor a model on the Hugging Face Hub"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if offline else "the Hub could not be reached to download it"
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local directory nor in the Hugging Face cache ({cache}), and {why}: "
            f"download it where there is network (`hf download {repo_id}`) or give a local directory"
        ) from None


def next_run_dir(root: str | Path = "runs") -> Path:
    """A new numbered directory under `root` (runs/001, runs/002, ...), created."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    while True:  # two commands started at once: the one that loses the mkdir takes the next number
        taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()]
        run_dir = root / f"{max(taken, default=0) + 1:03d}"
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        return run_dir

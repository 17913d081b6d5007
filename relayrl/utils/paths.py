"""Where things live: the shipped model, run directories."""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
_BUILTIN_PREFIX = "builtin:"


def resolve_tokenizer_path(name: str) -> Path:
    """Like resolve_model_path, but a directory holding only tokenizer files (no config.json) is accepted."""
    if name.startswith(_BUILTIN_PREFIX):
        return resolve_model_path(name)
    path = Path(name).expanduser()
    if path.is_dir() and ((path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()):
        return path
    return resolve_model_path(name)


def resolve_model_path(name: str) -> Path:
    """Map `builtin:<name>` to the copy shipped inside the package; anything else is a local directory.

    Raises FileNotFoundError / NotADirectoryError naming the path, so a typo fails before any model code runs.
    """
    if name.startswith(_BUILTIN_PREFIX):
        path = _ASSETS / name[len(_BUILTIN_PREFIX) :]
        if not path.is_dir():
            available = sorted(p.name for p in _ASSETS.iterdir() if p.is_dir()) if _ASSETS.is_dir() else []
            raise FileNotFoundError(f"no built-in model {name!r}; available: {', '.join(available) or 'none'}")
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"model path is not a directory: {path}")
    if not (path / "config.json").is_file():
        raise ValueError(f"not a Hugging Face model directory (no config.json): {path}")
    return path


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

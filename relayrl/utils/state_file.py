"""State files that cannot run code when they are read back: tensors in safetensors, everything else (nested
dicts, lists, tuples, numpy values, non-finite floats) as JSON in the file's metadata, restored exactly.

Checkpoints store the dataloader position and the RNG states this way instead of pickling them (a pickle from a
crafted or older checkpoint could execute anything on resume); `assert_finite_state` is the save path's guard that
no checkpoint ever holds NaN or infinite weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CheckpointError",
    "NonFiniteStateError",
    "STATE_FORMAT",
    "STATE_VERSION",
    "assert_finite_state",
    "load_state_file",
    "save_state_file",
]

STATE_FORMAT = "relayrl-state"
STATE_VERSION = "1"


class CheckpointError(ValueError):
    """A checkpoint (or a file in it) that cannot be used: refused to load, or a directory another run owns.

    The message is one line and names the file or directory. A ValueError, so the CLI reports it as bad input
    (one line, exit 2) like every set-up error."""


class NonFiniteStateError(CheckpointError):
    """Tensors about to be checkpointed hold NaN or infinity (see `assert_finite_state`)."""


# ---------------------------------------------------------------------------------------------------- state files
def save_state_file(path: str | Path, state: Any) -> None:
    """Write `state` (nested dicts, lists, tuples, str/int/float/bool/None, torch tensors, numpy arrays and
    scalars) to a safetensors file: the tensors as tensors, the structure as JSON in its metadata.

    `load_state_file` gives it back exactly (types, dtypes, shapes, bits). Anything else raises TypeError here,
    so a state that could not be restored is never written."""
    import safetensors.torch

    tensors: dict[str, Any] = {}
    tree = _encode(state, tensors, "state")
    metadata = {"format": STATE_FORMAT, "version": STATE_VERSION, "tree": json.dumps(tree, allow_nan=False)}
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def load_state_file(path: str | Path) -> Any:
    """Read what `save_state_file` wrote. Nothing in the file can run code: a pickle (e.g. an older relayrl's
    torch.save file) or anything else that is not such a state file raises `CheckpointError` naming the file."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint state ({exc.strerror or exc})") from exc
    # Parse first, sniff after: a safetensors header is a little-endian length whose first byte can be anything
    # (0x80 included), so the pickle signature is only used to word the refusal of a file that did not parse.
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != STATE_FORMAT or meta.get("version") != STATE_VERSION:
                raise ValueError(f"no {STATE_FORMAT} v{STATE_VERSION} header")
            return _decode(json.loads(meta["tree"]), f.get_tensor)
    except Exception as exc:  # safetensors' own error type, bad JSON, a malformed tree: all mean "refuse"
        if head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip container, or a raw pickle
            raise CheckpointError(
                f"{path}: a pickle, not a relayrl state file; refusing to load it (unpickling can run code)"
            ) from exc
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: not a valid relayrl state file ({reason}); refusing to load it") from exc


_TAGS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__", "__npscalar__", "__float__")


def _encode(value: Any, tensors: dict[str, Any], where: str) -> Any:
    import numpy as np
    import torch

    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            "__dict__": [
                [_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()
            ]
        }
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().to("cpu").contiguous().clone()
        return {"__tensor__": name}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return {"__ndarray__": [value.dtype.str, list(value.shape), _encode(value.tolist(), tensors, where)]}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return {"__npscalar__": [value.dtype.str, _encode(value.item(), tensors, where)]}
    raise TypeError(f"cannot store {type(value).__qualname__} at {where} in a checkpoint state file")


def _decode(value: Any, get_tensor: Callable[[str], Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, get_tensor) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "__tuple__":
            return tuple(_decode(v, get_tensor) for v in body)
        if tag == "__dict__":
            return {_decode(k, get_tensor): _decode(v, get_tensor) for k, v in body}
        if tag == "__tensor__":
            return get_tensor(body)
        if tag == "__float__":
            return float(body)
        if tag in ("__ndarray__", "__npscalar__"):
            import numpy as np

            if tag == "__npscalar__":
                return np.dtype(body[0]).type(_decode(body[1], get_tensor))
            dtype, shape, data = body
            return np.array(_decode(data, get_tensor), dtype=np.dtype(dtype)).reshape(shape)
    return {k: _decode(v, get_tensor) for k, v in value.items()}


# ---------------------------------------------------------------------------------------------------- finite hook
def assert_finite_state(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], what: str) -> None:
    """Raise `NonFiniteStateError` if a floating-point tensor among `tensors` (a state_dict, or (name, tensor)
    pairs) holds NaN or ±inf; `what` names the owner in the message ("policy weights", "value weights").

    The hook for the save path: call it before a checkpoint is finalized so none ever holds non-finite weights.
    Costs one `isfinite` pass over each tensor; integer and bool tensors are skipped."""
    import torch

    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    bad: list[str] = []
    total = 0
    for name, t in items:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            total += 1
            if not bool(torch.isfinite(t).all()):
                bad.append(name)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteStateError(
            f"{what}: NaN or infinity in {len(bad)} of {total} tensors ({shown}); not checkpointed"
        )

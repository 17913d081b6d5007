"""The pickled form of `KVBatchMeta`: the handle crosses the driver and Ray on every dispatch, so it travels small.

A naive pickle of a step handle (every key in full, and per-row tag dicts) is a visible share of what the step
writes to the store on short sequences (docs/design.md has the figures). Keys minted as `f"{uid}_g{i}"` share
their uid across a prompt's generations, and tags are columns of numbers, so the wire form stores each distinct
uid once with small integer indices, and tags and sequence lengths as packed arrays. Decoding gives back an equal
handle (same keys in the same order, same tags, same types); anything that does not fit the compact layout is
pickled as it is.
"""

from __future__ import annotations

import re
from array import array
from typing import Any

_KEY = re.compile(r"^(.+)_g(\d+)$")


def _pack_ints(values: list[int]) -> tuple[str, bytes]:
    """Non-negative ints < 2**32 in the narrowest array type that holds them."""
    top = max(values, default=0)
    code = "B" if top < 2**8 else "H" if top < 2**16 else "I"
    return code, array(code, values).tobytes()


def _unpack_ints(packed: tuple[str, bytes]) -> list[int]:
    arr = array(packed[0])
    arr.frombytes(packed[1])
    return arr.tolist()


def pack_keys(keys: list[str]) -> tuple[Any, ...]:
    """(`"uid"`, distinct uids, uid index per key, generation per key) when every key is `uid_gN`, else the list."""
    uids: dict[str, int] = {}
    which: list[int] = []
    gens: list[int] = []
    for key in keys:
        m = _KEY.match(key)
        if m is None or int(m.group(2)) >= 2**32 or str(int(m.group(2))) != m.group(2):
            return ("plain", keys)
        which.append(uids.setdefault(m.group(1), len(uids)))
        gens.append(int(m.group(2)))
    return ("uid", list(uids), _pack_ints(which), _pack_ints(gens))


def unpack_keys(packed: tuple[Any, ...]) -> list[str]:
    if packed[0] == "plain":
        return list(packed[1])
    _, uids, which, gens = packed
    return [f"{uids[u]}_g{g}" for u, g in zip(_unpack_ints(which), _unpack_ints(gens))]


def pack_tags(tags: list[dict[str, Any]] | None) -> tuple[Any, ...]:
    """Columns (float32 when exact, else float64; int64) when every row has the same names and plain numeric
    values, else the list."""
    if not tags:
        return ("plain", tags)
    names = list(tags[0])
    columns: dict[str, tuple[str, bytes]] = {}
    for name in names:
        values: list[Any] = [t.get(name) for t in tags]
        if all(type(v) is float for v in values):
            as_f32 = array("f", values)  # float32 tensors' values stamped as floats fit 4 bytes exactly
            code = "f" if as_f32.tolist() == values else "d"
            columns[name] = (code, as_f32.tobytes() if code == "f" else array("d", values).tobytes())
        elif all(type(v) is int for v in values) and all(-(2**63) <= v < 2**63 for v in values):
            columns[name] = ("q", array("q", values).tobytes())
        else:
            return ("plain", tags)
    if any(list(t) != names for t in tags):
        return ("plain", tags)
    return ("columns", len(tags), columns)


def unpack_tags(packed: tuple[Any, ...]) -> list[dict[str, Any]] | None:
    if packed[0] == "plain":
        return packed[1]
    _, n, columns = packed
    decoded: dict[str, list[Any]] = {}
    for name, (code, raw) in columns.items():
        arr = array(code)
        arr.frombytes(raw)
        decoded[name] = arr.tolist()
    return [{name: decoded[name][i] for name in columns} for i in range(n)]


def pack_lengths(lengths: list[int] | None) -> Any:
    if lengths is None or not all(type(v) is int and 0 <= v < 2**32 for v in lengths):
        return lengths
    return _pack_ints(lengths)


def unpack_lengths(packed: Any) -> list[int] | None:
    return _unpack_ints(packed) if isinstance(packed, tuple) else packed

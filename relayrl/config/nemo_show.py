"""Every key of a NeMo RL config classified, for `relayrl config show`: mapped, not used (engine-only) or refused.

Loading stops at the first refused key; `config show` must name them all. So the classification translates the
config, and on a refusal records the key, removes it and translates again, until what is left loads; then each
leaf key of the file is marked by what the rules recorded for it (or for the block holding it).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from relayrl.config.nemo_base import NemoLayoutError, Rules
from relayrl.config.nemo_layout import resolved, translate_nemo_layout

__all__ = ["classify_keys", "format_classification"]

_LOC = re.compile(r"^(?:unknown config key: |invalid config value for )([\w.]+)")


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [prefix.removesuffix(".")]


def _remove(cfg: dict[str, Any], key: str) -> bool:
    """Drop `key` (or the deepest block of it that exists) from `cfg`; False when nothing of it is there."""
    parts = key.split(".")
    while parts:
        probe = Rules(cfg)
        if probe.has(".".join(parts)):
            probe.pop(".".join(parts))
            return True
        parts.pop()
    return False


def _within(key: str, block: str) -> bool:
    return key == block or key.startswith(block + ".") or block.startswith(key + ".")


def classify_keys(raw: dict[str, Any], validate: Callable[[dict[str, Any]], Any]) -> tuple[list[tuple[str, str]], bool]:
    """([(key, what relayrl does with it)] for every leaf key of `raw`, whether the config is in NeMo RL's layout).

    `validate` is the pydantic validation (raising an error whose message starts `unknown config key: K` or
    `invalid config value for K`), so keys relayrl's schema refuses are marked refused too."""
    try:
        base = resolved(raw)
    except NemoLayoutError as exc:
        return [(exc.key, f"refused: {exc}")], True
    work = copy.deepcopy(base)
    refused: dict[str, str] = {}
    unused: list[str] = []
    mapped: dict[str, str] = {}
    for _ in range(len(_leaves(base)) + 1):
        try:
            tr = translate_nemo_layout(work)
        except NemoLayoutError as exc:
            refused.setdefault(exc.key, str(exc))
            if not _remove(work, exc.key):
                break
            continue
        unused, mapped = [u.split("=", 1)[0].split(" ", 1)[0] for u in tr.unused], tr.mapped
        try:
            validate(tr.config)
        except ValueError as exc:
            found = _LOC.match(str(exc))
            if found is None or not _remove(work, found.group(1)):
                refused.setdefault("config", str(exc))
                break
            refused.setdefault(found.group(1), str(exc))
            continue
        break
    rows = []
    for leaf in _leaves(base):
        why = next((msg for key, msg in refused.items() if _within(leaf, key)), None)
        block = next((u for u in unused if _within(leaf, u)), None)
        target = next((t for s, t in mapped.items() if _within(leaf, s)), None)
        if why is not None:
            rows.append((leaf, f"refused: {why}"))
        elif block is not None:
            rows.append((leaf, "not used by relayrl (engine-only)"))
        elif target is not None:
            rows.append((leaf, f"mapped -> {target}"))
        else:
            rows.append((leaf, "mapped -> same key"))
    if "config" in refused:
        rows.append(("(whole config)", f"refused: {refused['config']}"))
    return rows, bool(refused or unused or mapped)


def format_classification(rows: list[tuple[str, str]]) -> str:
    """The rows as YAML comment lines, one key a line, for the top of `config show`."""
    lines = ["# NeMo RL layout: what relayrl does with each key of this config"]
    lines += [f"#   {key}: {what}" for key, what in rows]
    return "\n".join(lines) + "\n"

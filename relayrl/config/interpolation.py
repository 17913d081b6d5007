"""`${...}` interpolations in a raw config, as NeMo RL's YAML files write them (OmegaConf syntax), resolved before
validation: `${policy.model_name}` (absolute), `${.temperature}` (a sibling), `${..x}` (the parent's), and the
resolvers `${mul:a,b}`, `${max:a,b}`, `${min:a,b}` with nested references. A string that is one interpolation becomes
the referenced value with its type; inside longer text the value is spliced in as text. Anything else (an unknown
resolver, a missing key, a cycle) is a one-line `ValueError` naming the key that holds it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

__all__ = ["has_interpolation", "resolve_interpolations"]

_INNERMOST = re.compile(r"\$\{([^${}]*)\}")
_RESOLVERS: dict[str, Callable[[list[float]], float]] = {"mul": math.prod, "max": max, "min": min}


def has_interpolation(node: Any) -> bool:
    """Whether any string in the tree holds `${`."""
    if isinstance(node, dict):
        return any(has_interpolation(v) for v in node.values())
    if isinstance(node, list):
        return any(has_interpolation(v) for v in node)
    return isinstance(node, str) and "${" in node


def resolve_interpolations(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with every interpolation replaced by its value."""
    resolver = _Resolver(raw)
    return resolver.walk(raw, ())


class _Resolver:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.active: list[str] = []  # keys being resolved, to catch cycles

    def walk(self, node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            return {k: self.walk(v, (*path, str(k))) for k, v in node.items()}
        if isinstance(node, list):
            return [self.walk(v, (*path, str(i))) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return self.text(node, path)
        return node

    def text(self, text: str, path: tuple[str, ...]) -> Any:
        """Resolve innermost interpolations first until none is left; `path` is the key holding `text`."""
        key = ".".join(path)
        if key in self.active:
            raise ValueError(f"{key}: interpolation cycle ({' -> '.join([*self.active, key])})")
        self.active.append(key)
        try:
            while (match := _INNERMOST.search(text)) is not None:
                value = self.evaluate(match.group(1).strip(), path)
                if match.span() == (0, len(text)):
                    return value
                text = text[: match.start()] + _as_text(value) + text[match.end() :]
            return text
        finally:
            self.active.pop()

    def evaluate(self, expr: str, path: tuple[str, ...]) -> Any:
        key = ".".join(path)
        name, sep, args = expr.partition(":")
        if sep and not name.startswith("."):
            if name not in _RESOLVERS:
                raise ValueError(f"{key}: unsupported interpolation ${{{expr}}} (relayrl resolves mul, max, min)")
            numbers = [_number(a.strip(), key, expr) for a in args.split(",")]
            return _RESOLVERS[name](numbers)
        dots = len(expr) - len(expr.lstrip("."))
        parent = path[:-1]
        if dots == 0:
            base: tuple[str, ...] = ()
        else:
            if dots - 1 > len(parent):
                raise ValueError(f"{key}: ${{{expr}}} climbs above the top of the config")
            base = parent[: len(parent) - (dots - 1)]
        target = (*base, *[p for p in expr.lstrip(".").split(".") if p])
        node: Any = self.root
        for part in target:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"{key}: ${{{expr}}} names {'.'.join(target)}, which the config does not have")
        return self.walk(node, target)


def _number(text: str, key: str, expr: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{key}: ${{{expr}}} needs numbers, got {text!r}") from None


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)

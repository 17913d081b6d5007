"""The primitives the NeMo RL layout rules are written with (`nemo_layout`, `nemo_data`), and what they record.

Each primitive acts on one dotted key and records what became of it, so the same rules that translate a config also
classify every key of it for `relayrl config show`: mapped (and to what), not used (engine-only), or refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ABSENT", "OFF", "NemoLayoutError", "Rules", "Translation"]

#: `get`'s default when `has` asks: no config value is this object.
ABSENT = object()
OFF: tuple[Any, ...] = (None, False, 0, {}, [], "")  # a feature left off


class NemoLayoutError(ValueError):
    """A NeMo RL key whose value would change results and relayrl cannot honour (one line: the key and the fix).

    `key` names the offending key so `config show` can mark it refused and go on classifying the others."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key if key is not None else message.split("=", 1)[0].split(" ", 1)[0].split(":", 1)[0]


@dataclasses.dataclass
class Translation:
    config: dict[str, Any]
    """The config in relayrl's layout (still to be validated)."""
    unused: list[str]
    """NeMo RL keys accepted and not used, in the order met (a block is named once)."""
    mapped: dict[str, str] = dataclasses.field(default_factory=dict)
    """NeMo RL key -> what it became in relayrl's layout (a key, or a note such as "met: relayrl's default")."""


class Rules:
    """A raw config and the primitives that map, drop or refuse its keys, recording each outcome."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.unused: list[str] = []
        self.mapped: dict[str, str] = {}

    def has(self, key: str) -> bool:
        return self.get(key, ABSENT) is not ABSENT

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.cfg
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def pop(self, key: str) -> Any:
        *parents, leaf = key.split(".")
        node: Any = self.cfg
        for part in parents:
            node = node[part]
        return node.pop(leaf)

    def put(self, key: str, value: Any, source: str) -> None:
        """Set relayrl's `key` from NeMo RL's `source`, unless the config already sets it to something else."""
        if self.has(key) and self.get(key) != value:
            raise NemoLayoutError(
                f"{source} ({value!r}) and {key} ({self.get(key)!r}) disagree; set one of them", source
            )
        *parents, leaf = key.split(".")
        node = self.cfg
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value
        if source != key:
            self.mapped.setdefault(source, key)

    def move(self, source: str, target: str) -> None:
        if self.has(source):
            self.put(target, self.pop(source), source)

    def drop(self, *keys: str, allowed: tuple[Any, ...] | None = None, why: str = "") -> None:
        """Accept `keys` as not used (any value, or only `allowed` ones: another is refused with `why`)."""
        for key in keys:
            if not self.has(key):
                continue
            value = self.get(key)
            if allowed is not None and value not in allowed:
                raise NemoLayoutError(f"{key}={value!r}: {why}", key)
            self.pop(key)
            self.unused.append(key)

    def block(self, key: str, *, enabled: str = "enabled", why: str = "") -> None:
        """A whole block relayrl lacks: not used while its `enabled` flag is off, refused when on."""
        if not self.has(key):
            return
        value = self.get(key)
        if isinstance(value, dict) and value.get(enabled) not in OFF:
            raise NemoLayoutError(f"{key}.{enabled}=true: {why}", f"{key}.{enabled}")
        if not isinstance(value, dict) and value not in OFF:
            raise NemoLayoutError(f"{key} is set: {why}", key)
        self.pop(key)
        self.unused.append(key)

    def require(self, key: str, allowed: tuple[Any, ...], why: str, met: str = "met: relayrl always does this") -> None:
        """A key relayrl honours only at `allowed` values (where it needs no key of its own): dropped there."""
        if self.has(key):
            value = self.get(key)
            if value not in allowed:
                raise NemoLayoutError(f"{key}={value!r}: {why}", key)
            self.pop(key)
            self.mapped[key] = met

"""Checks shared by the seed-page tests (`tests/unit/seeds/test_seed_*.py`).

Each test writes a seed entry out as a stub `def` with the page's parameter names, order, `*` markers and defaults
(annotations left out: the page's types name the reference's modules). relayrl's object must agree on every
parameter; it may add parameters only with a default and only where they change no positional meaning.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

P = inspect.Parameter
VARIADIC = (P.VAR_POSITIONAL, P.VAR_KEYWORD)


def parameters(fn: Callable[..., Any]) -> list[tuple[str, str, Any]]:
    """(name, kind, default) of each parameter except self, in order; default `inspect.Parameter.empty` if none."""
    return [
        (p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in ("self",)
    ]


def assert_seed_signature(actual: Callable[..., Any], seed: Callable[..., Any], *, exact: bool = False) -> None:
    """`actual` takes `seed`'s parameters: same names in the same order, same kinds, same defaults.

    `exact`: nothing else (the seed's abstract interfaces). Otherwise extra parameters are allowed when they have a
    default (or are *args/**kwargs) and are keyword-only or come after every positional parameter of the seed.
    """
    want, got = parameters(seed), parameters(actual)
    shown = f"\n  seed:    {want}\n  relayrl: {got}"
    if exact:
        assert got == want, f"{actual.__qualname__} differs from the seed{shown}"
        return
    names = [name for name, _, _ in want]
    assert [p for p in got if p[0] in names] == want, f"{actual.__qualname__}: seed parameters differ{shown}"
    seed_positional = {name for name, kind, _ in want if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")}
    for i, (name, kind, default) in enumerate(got):
        if name in names or kind in (k.name for k in VARIADIC):
            continue
        assert default is not P.empty, f"{actual.__qualname__}: extra parameter {name!r} has no default{shown}"
        later = [n for n, _, _ in got[i + 1 :] if n in seed_positional]
        assert kind == "KEYWORD_ONLY" or not later, (
            f"{actual.__qualname__}: extra positional {name!r} comes before the seed's {later}{shown}"
        )


def assert_typeddict(cls: type, keys: list[str]) -> None:
    """`cls` is a TypedDict whose keys are exactly `keys` (in order), all required."""
    assert typing.is_typeddict(cls), f"{cls.__name__} is not a TypedDict"
    assert list(cls.__annotations__) == keys, f"{cls.__name__}: keys {list(cls.__annotations__)} != seed {keys}"
    assert cls.__required_keys__ == frozenset(keys)  # type: ignore[attr-defined]


def seed_methods(stub: type) -> list[str]:
    """The method names a seed stub class writes out, in page order."""
    return [name for name, value in vars(stub).items() if inspect.isfunction(value)]

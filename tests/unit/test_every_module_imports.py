"""Every module of the package imports: the quick subset (`-m quick`) thereby touches the few modules whose
behaviour only the integration tests run (the async producer's source, replay, parity, the Ray executor...)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import relayrl

MODULES = sorted(m.name for m in pkgutil.walk_packages(relayrl.__path__, "relayrl."))


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    assert importlib.import_module(name).__name__ == name

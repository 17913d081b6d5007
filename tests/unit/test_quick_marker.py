"""The `quick` subset (`bash scripts/test.sh -m quick`) is set by tests/conftest.py: unit tests without Ray are in it,
Ray-marked ones are not."""

from __future__ import annotations

import pytest


def test_a_unit_test_without_ray_is_quick(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("quick") is not None


@pytest.mark.ray
def test_a_ray_marked_test_is_not_quick(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("quick") is None

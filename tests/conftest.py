"""Shared fixtures. Tests build their own tiny models (seconds) so none depends on network or the hub."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread: the suite shares two cores; oversubscription makes timings erratic, not faster.
torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`--dist loadgroup`, as scripts/test.sh runs it) each module's `ray` tests run on one
    worker, in file order: the module's `ray_cluster` (a fresh local Ray of its own, `address="local"`) serves only
    them. Two modules' clusters may run side by side, one per worker, each owned by its module; no test ever joins
    another module's cluster."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group(f"ray:{item.path.name}"))


def pytest_configure(config: pytest.Config) -> None:
    """pytest 9.2 with pytest-xdist 3.8 silently drops `--dist loadgroup`'s groups: say so in one line instead."""
    if getattr(config.option, "dist", "no") == "loadgroup" and pytest.version_tuple >= (9, 2):
        import xdist

        if tuple(int(p) for p in xdist.__version__.split(".")[:2]) <= (3, 8):
            raise pytest.UsageError(
                f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} ignores --dist loadgroup (the ray "
                "tests would share the machine with a second Ray): install the dev extra's pins (pytest<9.2)"
            )


def pytest_collection_finish(session: pytest.Session) -> None:
    """A `ray` test that xdist would schedule outside the group is a configuration fault: stop before running (the
    check above knows one bad pair of versions; this one sees the effect)."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    loose = [i.nodeid for i in session.items if i.get_closest_marker("ray") and "@ray:" not in i.nodeid]
    if loose:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(loose)} ray tests (e.g. {loose[0]}): this pytest and pytest-xdist do not "
            "work together; install the versions pyproject.toml's dev extra pins"
        )


@pytest.fixture(scope="session")
def char_tokenizer():
    """The character-level tokenizer the shipped model uses (chat template, pad and eos set)."""
    from relayrl.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, char_tokenizer) -> Path:
    """A random 2-layer Qwen2 + tokenizer saved as a Hugging Face directory (loaded via from_pretrained); the model is
    tests.helpers.build_test_model's."""
    from relayrl.models.tiny import save_tiny_model
    from tests.helpers import build_test_model

    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(path, build_test_model(char_tokenizer), char_tokenizer)
    return path


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """A local Ray for one test module, shut down at its end if this fixture started it.

    num_cpus is the module's `RAY_NUM_CPUS` (default 4: on 2 cores TransferQueue's actors wait forever with fewer);
    no dashboard, worker logs kept out of the test output, no token file written to the home directory."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # left running by an earlier module: its size and leftovers are not this module's
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",  # always a new cluster: never one another test module (or a `ray start`) left running
        num_cpus=getattr(request.module, "RAY_NUM_CPUS", 4),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()

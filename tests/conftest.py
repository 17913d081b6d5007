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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`quick` (`bash scripts/test.sh -m quick`, the inner loop): every test outside tests/integration that starts
    no Ray and is neither slow nor GPU-only; the unit tests mirror the package, so it touches every module."""
    for item in items:
        if "integration" not in item.path.parts and not any(item.get_closest_marker(m) for m in ("ray", "slow", "gpu")):
            item.add_marker(pytest.mark.quick)


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
    """A local Ray for one test module, shut down at its end if this fixture started it. scripts/test.sh runs the
    suite with `--dist loadscope`: a module's tests stay on one worker, so the cluster serves them alone (another
    worker's module may run its own cluster beside it; `address="local"` never joins one).

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

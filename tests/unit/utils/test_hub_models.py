"""Models by Hub id resolve through the Hugging Face cache; offline and not cached is one line saying so."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from relayrl.utils.paths import resolve_model_path, resolve_tokenizer_path

REPO = "relayrl-test/tiny-arith-instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """Lay `source`'s files out as huggingface_hub caches a download: blobs, a snapshot of links, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in source.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(hf_cache):
    snapshot = populate_cache(hf_cache, REPO, resolve_model_path("builtin:tiny-arith"))
    assert resolve_model_path(REPO) == snapshot
    assert resolve_tokenizer_path(REPO) == snapshot
    assert (resolve_model_path(REPO) / "config.json").read_bytes() == (
        resolve_model_path("builtin:tiny-arith") / "config.json"
    ).read_bytes()


def test_offline_and_not_cached_is_one_line(hf_cache):
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("someone/not-cached-model")
    message = str(info.value)
    assert "\n" not in message
    assert "'someone/not-cached-model'" in message and "HF_HUB_OFFLINE=1" in message and str(hf_cache) in message


def test_a_local_directory_wins_over_a_hub_id(hf_cache, tmp_path, monkeypatch):
    local = tmp_path / "org" / "model"
    shutil.copytree(resolve_model_path("builtin:tiny-arith"), local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/model") == Path("org/model")


def test_a_missing_absolute_path_is_not_taken_for_a_hub_id(hf_cache, tmp_path):
    with pytest.raises(FileNotFoundError, match="model path does not exist"):
        resolve_model_path(str(tmp_path / "missing"))

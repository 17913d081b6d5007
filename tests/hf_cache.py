"""A Hugging Face datasets cache in a temporary directory, holding a dataset as `datasets.load_dataset` leaves it, so
tests load named Hub datasets offline (no network here): `load_dataset(repo_id, config, split=...)` finds it."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path
from typing import Any

import pytest


def offline_cache(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point HF_HOME / HF_DATASETS_CACHE at `root` (env and the already-imported `datasets.config`), Hub offline."""
    import datasets

    cache = root / "datasets"
    monkeypatch.setenv("HF_HOME", str(root))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def save_to_cache(cache: Path, repo_id: str, config: str, split: str, rows: list[dict[str, Any]]) -> None:
    """Write `rows` as split `split` of `repo_id` / `config` into `cache`, where load_dataset looks for it offline:
    `<cache>/<org>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow` plus its dataset_info.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    org, name = repo_id.split("/")
    source = cache.parent / f"{org}_{name}_{split}.parquet"
    cache.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), source)
    folder = f"{org}___{name}"
    builder = Parquet(
        cache_dir=str(cache), dataset_name=folder, config_name=config, hash="0" * 16, data_files={split: str(source)}
    )
    builder.download_and_prepare()
    built = camelcase_to_snakecase(folder)  # the builder snake-cases the whole name (HuggingFaceH4 -> hugging_face_h4)
    snake = camelcase_to_snakecase(name)  # load_dataset looks under <org>___<snake-cased name> (MATH-500 -> math-500)
    root = (
        cache / f"{org}___{snake}"
    )  # the builder names the config after its data files and the files after the folder
    if cache / built != root:
        shutil.move(cache / built, root)
    for config_dir in glob.glob(str(root / f"{config}-*")):
        shutil.move(config_dir, root / config)
    for arrow in glob.glob(str(root / config / "*" / "*" / "*.arrow")):
        os.rename(arrow, arrow.replace(f"{built}-", f"{snake}-"))

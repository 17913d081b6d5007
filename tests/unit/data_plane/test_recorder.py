"""Flight recorder files: a step's columns survive the Parquet round trip bit for bit, and keep_last bounds disk."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from relayrl.data_plane.codec import Column
from relayrl.data_plane.recorder import read_step, recorded_steps, table_column, table_info, write_step


def _columns(n: int = 3) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([4, 1, 6][:n])
    tokens = int(lengths.sum())
    return {
        "sample_key": [f"k_g{i}" for i in range(n)],
        "prompt": ["a", "b", "c"][:n],
        "input_ids": Column.jagged(torch.randint(0, 100, (tokens,), generator=gen), lengths),
        "logprobs": Column.jagged(torch.randn(tokens, generator=gen), lengths),
        "bf16": Column.jagged(torch.randn(tokens, generator=gen).to(torch.bfloat16), lengths),
        "token_mask": Column.jagged(torch.rand(tokens, generator=gen) > 0.5, lengths),
        "advantages": torch.randn(n, generator=gen),
        "truncated": [False, True, False][:n],
    }


def test_round_trip_is_exact(tmp_path):
    cols = _columns()
    write_step(tmp_path, 7, cols, {"rollout_metrics": {"total_turns": 3}}, keep_last=5)
    table = read_step(tmp_path, 7)
    assert table.column("sample_key").to_pylist() == cols["sample_key"]
    assert table.column("input_ids").to_pylist()[1] == cols["input_ids"].row(1).tolist()  # type: ignore[union-attr]
    for name in ("input_ids", "logprobs", "bf16", "token_mask"):
        back, orig = table_column(table, name), cols[name]
        assert isinstance(orig, Column)
        assert back.dtype == orig.dtype and torch.equal(back.values, orig.values), name
        assert torch.equal(back.lengths, orig.lengths)  # type: ignore[arg-type]
    adv = table_column(table, "advantages")
    assert adv.lengths is None and torch.equal(adv.values, cols["advantages"])  # type: ignore[arg-type]
    assert table_info(table) == {"rollout_metrics": {"total_turns": 3}}
    assert pq.read_table(tmp_path / "step_000007.parquet").num_rows == 3  # plain pyarrow reads it


def test_keep_last_deletes_the_oldest(tmp_path):
    for step in range(1, 6):
        write_step(tmp_path, step, _columns(), {}, keep_last=2)
    assert recorded_steps(tmp_path) == [4, 5]
    assert not list(tmp_path.glob(".*tmp"))  # atomic writes leave nothing behind


def test_missing_step_names_what_is_recorded(tmp_path):
    write_step(tmp_path, 2, _columns(), {}, keep_last=3)
    with pytest.raises(FileNotFoundError, match=r"step 9 .*steps 2\.\.2 \(1 files\).*every_n_steps=1"):
        read_step(tmp_path, 9)


def test_row_count_mismatch_is_refused(tmp_path):
    cols = _columns()
    cols["prompt"] = ["only one"]
    with pytest.raises(ValueError, match="'prompt' has 1 rows for 3 samples"):
        write_step(tmp_path, 1, cols, {}, keep_last=1)

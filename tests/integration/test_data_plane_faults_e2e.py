"""A data-plane row that changes in the store between its put and its get ends the run in that step with one line
naming the key and the field, and the command that resumes (data_plane.verify_checksums, on by default)."""

from __future__ import annotations

import functools
from pathlib import Path

from relayrl.cli.main import main
from relayrl.data_plane.memory import ColumnarStore
from tests.helpers import tiny_grpo_overrides
from tests.unit.data_plane.contract_integrity import corrupt_columnar_store


def test_a_row_corrupted_in_the_store_stops_the_step(tiny_model_dir: Path, tmp_path: Path, capsys, monkeypatch):
    corrupted: list[tuple[str, str]] = []
    real_put = ColumnarStore.put_samples

    @functools.wraps(real_put)  # the memory client dispatches to the store by method name
    def put_then_corrupt(self, keys, partition_id, fields, *args, **kwargs):  # type: ignore[no-untyped-def]
        meta = real_put(self, keys, partition_id, fields, *args, **kwargs)
        if "advantages" in fields and not corrupted:  # the first advantages written: flip a bit of one row's
            key = list(keys)[3]
            corrupt_columnar_store(self, partition_id, key, "advantages")
            corrupted.append((partition_id, key))
        return meta

    monkeypatch.setattr(ColumnarStore, "put_samples", put_then_corrupt)
    run = tmp_path / "run"
    overrides = tiny_grpo_overrides(tiny_model_dir, "grpo.max_num_steps=2", "grpo.val_period=0")
    assert main(["train", "--run-dir", str(run), *overrides]) == 1
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("relayrl: error:")]
    assert len(errors) == 1, errors
    (pid, key), line = corrupted[0], errors[0]
    assert key in line and "advantages" in line and pid in line
    assert f"`relayrl train --run-dir {run}` resumes" in line
    assert not list((run / "checkpoints").glob("step_*"))  # the step never finished: no resume point past it

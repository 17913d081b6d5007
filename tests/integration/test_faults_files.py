"""Commands on damaged runs verify what they read and fail with one line naming the damaged file (issue 31, item 3):
`evaluate` and `export` check the checkpoint's manifest, `inspect`, `replay` and `diff` the recordings' Parquet
footers and page checksums, `plot` says where it could not write. One tiny 2-step run serves the module; each test
damages its own copy. The data-plane trainer's run covers the legacy trainer's too: both write checkpoints through the
one step tail (`runner.StepTail.save`) and recordings through the one writer (`data_plane.recorder.write_step`), and
these commands read them alike whichever trainer wrote them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from relayrl.cli.main import main
from tests.helpers import CHECKPOINT_EVERY_STEP, tiny_grpo_overrides


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    run = tmp_path_factory.mktemp("faults_files") / "run"
    overrides = tiny_grpo_overrides(tiny_model_dir, *CHECKPOINT_EVERY_STEP, "grpo.max_num_steps=2")
    assert main(["train", "--run-dir", str(run), *overrides]) == 0
    return run


@pytest.fixture
def run(recorded: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(recorded, tmp_path / "run"))


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert len(lines) == 1 and lines[0].startswith("relayrl: error:") and "Traceback" not in err, err
    return lines[0]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_evaluate_and_export_refuse_a_damaged_checkpoint_naming_the_file(run, tmp_path, capsys, damage):
    weights = run / "checkpoints" / "step_2" / "policy" / "weights" / "model.safetensors"
    if damage == "flipped":
        _flip(weights, 5000)
    else:
        weights.write_bytes(weights.read_bytes()[:4000])
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run / "checkpoints" / "step_2")]) == 2
    line = _one_error(capsys)
    assert f"checkpoint {run}/checkpoints/step_2 is damaged: policy/weights/model.safetensors" in line
    assert main(["export", str(run), "--step", "2", "--out", str(tmp_path / "out")]) == 2
    assert "policy/weights/model.safetensors" in _one_error(capsys) and not (tmp_path / "out").exists()

    # without --step the newest intact checkpoint is exported, the damaged one named on its way
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert f"exported {run}/checkpoints/step_1 " in captured.out and "skipping checkpoint" in captured.err
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not list((run / "checkpoints").glob(".reading_*"))  # the reader's links are gone


def test_evaluate_names_a_model_directory_whose_weights_are_truncated(run, tmp_path, capsys):
    model = Path(shutil.copytree(run / "checkpoints" / "step_2" / "policy" / "weights", tmp_path / "model"))
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:4000])
    tokenizer = run / "checkpoints" / "step_2" / "policy" / "tokenizer"
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(model), f"policy.tokenizer.name={tokenizer}"]) == 2
    assert f"--checkpoint {model}: its weights could not be loaded" in _one_error(capsys)


@pytest.mark.parametrize("damage", ["truncated", "flipped_page"])
def test_inspect_replay_and_diff_name_a_damaged_recording(run, recorded, tmp_path, capsys, damage):
    path = run / "rollouts" / "step_000002.parquet"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:500])
    else:
        _flip(path, 100)  # inside the first data page: only its checksum tells
    capsys.readouterr()
    assert main(["inspect", str(run), "--step", "2"]) == 2
    assert f"flight recording {path} is damaged or truncated" in _one_error(capsys)
    assert main(["replay", str(run), "--from-step", "2", "--out", str(tmp_path / "replay")]) == 2
    assert f"flight recording {path} is damaged or truncated" in _one_error(capsys)
    # diff: identical metrics need no samples; a damaged recording of a divergent step is named, not a traceback
    assert main(["diff", str(recorded), str(run)]) == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "train/loss": 12345.0}\n')
    capsys.readouterr()
    assert main(["diff", str(recorded), str(run)]) == 1
    out = capsys.readouterr()
    assert f"flight recording {path} is damaged or truncated" in out.out and "Traceback" not in out.err


def test_replay_refuses_a_damaged_source_checkpoint(run, tmp_path, capsys):
    _flip(run / "checkpoints" / "step_1" / "train_dataloader.safetensors", 10)
    capsys.readouterr()
    assert main(["replay", str(run), "--from-step", "2", "--out", str(tmp_path / "replay")]) == 2
    assert "step_1 is damaged: train_dataloader.safetensors does not match its sha256" in _one_error(capsys)


def test_plot_names_where_it_could_not_write(run, capsys):
    blocker = run / "not_a_dir"
    blocker.write_text("a file where the plot's directory would be")
    capsys.readouterr()
    assert main(["plot", str(run), "--out", str(blocker / "metrics.png")]) == 2
    line = _one_error(capsys)
    assert f"cannot write {blocker}" in line and "pass --out PATH to write elsewhere" in line

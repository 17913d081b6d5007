"""Issue 14 (parts 1 and 7) end to end: a resumed run never unpickles anything from its run directory, skips a
damaged newest checkpoint for the previous complete one (and still resumes exactly), and removes the stale
temporaries a killed run left behind."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.utils.checkpoint import DATALOADER_STATE, MANIFEST, RNG_STATE, verify_checkpoint, write_manifest
from tests.helpers import EXACT_RUN, RunsCode, metrics_by_step, tiny_grpo_overrides

STEPS = 3


def _overrides(model_dir: Path, steps: int = STEPS) -> list[str]:
    return tiny_grpo_overrides(
        model_dir,
        *EXACT_RUN,
        "policy.train_global_batch_size=8",  # 2 prompts x 4 generations, one micro-batch
        "grpo.num_prompts_per_step=2",
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.val_period=0",
        "checkpointing.save_period=1",
        "checkpointing.keep_top_k=null",
    )


def _train_metrics(run_dir: Path) -> dict[int, dict]:
    """Last logged train metrics per step (a resumed run logs a step again after the one it resumed from)."""
    return metrics_by_step(run_dir, ("train/",), skip=("per_sec", "bytes", "fraction"))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """One 3-step run checkpointed at every step (step_1..step_3); each test works on a copy."""
    run_dir = tmp_path_factory.mktemp("checkpoint_safety") / "run"
    assert main(["train", "--run-dir", str(run_dir), *_overrides(tiny_model_dir)]) == 0
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert names == ["step_1", "step_2", "step_3"]
    return run_dir


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns(".owner.lock"))
    return dst


def test_checkpoint_holds_no_pickle(trained_run: Path) -> None:
    step = trained_run / "checkpoints" / "step_3"
    files = json.loads((step / MANIFEST).read_text())["files"]
    assert DATALOADER_STATE in files and RNG_STATE in files
    # The one torch.save file left is the optimizer's, read back with torch.load(weights_only=True).
    assert [p.relative_to(step).as_posix() for p in step.rglob("*.pt")] == ["policy/optimizer/optimizer.pt"]


@pytest.mark.parametrize(
    "case",
    ["dataloader_resealed", "rng_resealed", "old_format_dataloader", "old_format_rng"],
)
def test_crafted_pickle_is_refused_in_one_line_and_never_runs(
    trained_run: Path, tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """A pickle that would run a shell command, placed as the newest checkpoint's dataloader or RNG file: as the
    new-format file with the manifest re-sealed to match (a deliberate tamper), or as an older relayrl's `.pt`
    file (no manifest). Either way the run stops with one line naming the file, and the command never runs."""
    run_dir = _copy(trained_run, tmp_path)
    step = run_dir / "checkpoints" / "step_3"
    marker = tmp_path / "marker"
    payload = pickle.dumps(RunsCode(marker))
    if case.endswith("resealed"):
        target = step / (DATALOADER_STATE if case.startswith("dataloader") else RNG_STATE)
        target.write_bytes(payload)
        (step / MANIFEST).unlink()
        write_manifest(step, 3, periodic=True, save_period=1)
    else:  # what an older relayrl wrote: pickles and no manifest
        (step / MANIFEST).unlink()
        for name in (DATALOADER_STATE, RNG_STATE):
            (step / name).unlink()
        target = step / ("train_dataloader.pt" if case.endswith("dataloader") else "rng_state.pt")
        target.write_bytes(payload)
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_dir), *_overrides(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("relayrl: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"relayrl: error: {target}: "), err
    assert "refusing to load it" in errors[0] and "Traceback" not in err
    assert not marker.exists()
    assert step.is_dir()  # nothing was deleted or overwritten


@pytest.mark.parametrize("damage", ["truncated_weights", "no_manifest", "tampered_rng"])
def test_damaged_newest_checkpoint_is_skipped_and_resume_stays_exact(
    trained_run: Path, tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """step_3 damaged (weights truncated, manifest gone, or a pickle dropped over the RNG file without re-sealing):
    the run says it skips step_3, resumes from step_2, and logs step 3 exactly as the original run did. A stale
    tmp_step_* left by a killed save is removed at start."""
    run_dir = _copy(trained_run, tmp_path)
    reference = _train_metrics(trained_run)
    ckpts = run_dir / "checkpoints"
    step3 = ckpts / "step_3"
    marker = tmp_path / "marker"
    if damage == "truncated_weights":
        weights = next((step3 / "policy" / "weights").glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no_manifest":
        (step3 / MANIFEST).unlink()
    else:
        (step3 / RNG_STATE).write_bytes(pickle.dumps(RunsCode(marker)))
    stale = ckpts / "tmp_step_4"
    (stale / "policy").mkdir(parents=True)
    (stale / "policy" / "half_written").write_bytes(b"...")

    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_dir), *_overrides(tiny_model_dir)]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    skipped = [line for line in text.splitlines() if line.startswith("Skipping checkpoint")]
    assert len(skipped) == 1 and str(step3) in skipped[0], text
    assert f"Resumed from {ckpts / 'step_2'} (step 2)" in text
    assert f"Removed {stale}" in text and not stale.exists()
    assert not marker.exists()
    assert _train_metrics(run_dir)[3] == reference[3], "step 3 differs after resuming from step_2"
    assert verify_checkpoint(step3) is None  # the re-save replaced the damaged directory

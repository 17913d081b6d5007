"""Every command in the README runs (issue 17): the code blocks are read from README.md itself, so a command that
is added, changed or removed there changes what this test runs; a README command that no rule here knows fails.

Training commands run as written plus overrides that shrink them (one step, two prompts x four generations, small
validation): `SMALL` is appended, so the README's own values are overridden only where it sets the same keys. They
run in order in one working directory, as a reader would type them, so `runs/001` is the default run's directory
and later commands find it. Python blocks run with `relayrl.train` given the same shrinking overrides.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

import relayrl
from relayrl.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
RAY_NUM_CPUS = 8  # the README's 4-rank Ray run: 4 policy ranks and 4 generation workers

SMALL = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "ppo.num_prompts_per_step=2",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=8",
    "value.train_global_batch_size=8",
    "value.train_micro_batch_size=8",
    "grpo.max_num_steps=1",
    "ppo.max_num_steps=1",
    "grpo.max_val_samples=8",
    "grpo.val_batch_size=8",
    "ppo.max_val_samples=8",
    "ppo.val_batch_size=8",
    "logger.progress_bar=false",
]
#: Ray runs: a global batch that splits into up to 4 ranks of whole micro-batches.
SMALL_RAY = [*SMALL, "grpo.num_prompts_per_step=4", "policy.train_global_batch_size=16"]
SMALL_RAY += ["policy.train_micro_batch_size=4"]
#: The single-GPU example config, on this CPU: the shipped model, CPU precision and lengths (the rest as written).
CPU_FOR_GPU_CONFIG = ["policy.model_name=builtin:tiny-arith", "policy.precision=float32", "cluster.device=cpu"]
CPU_FOR_GPU_CONFIG += ["policy.max_total_sequence_length=64", "policy.generation.max_new_tokens=16"]
CPU_FOR_GPU_CONFIG += ["data.system_prompt=null", "data.max_input_seq_length=null", "policy.logprob_batch_size=8"]

#: Commands that are not run here, and why (each is run elsewhere).
NOT_HERE = {
    "bash scripts/setup.sh": "CI's set-up: scripts/test.sh runs it",
    "bash scripts/test.sh": "what CI runs",
    "bash scripts/test.sh -m quick": "CI's run, restricted to the quick subset (tests/conftest.py marks it)",
    ".venv/bin/python -m pytest -m ray": "the Ray-marked tests, this file's included",
    ".venv/bin/python -m pytest -m gpu": "the GPU-marked tests, on a CUDA machine",
}


def blocks(kind: str) -> list[str]:
    """The README's fenced code blocks of one language, in order."""
    return re.findall(rf"```{kind}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def commands() -> list[str]:
    """Every shell command of the README's bash blocks (comments dropped, `a && b` split)."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            out.extend(part.strip() for part in line.split("&&") if part.strip())
    return out


def kind_of(command: str) -> str:
    """How a README command is run: `skip` (see NOT_HERE), `ray`, `gpu`, `tensorboard` or `cli`."""
    if command in NOT_HERE:
        return "skip"
    if command.startswith("ray start") or "cluster.ray_address=auto" in command:
        return "gpu"  # joins a GPU Ray cluster: configs/grpo_ray_multigpu.yaml
    if command.startswith("tensorboard --logdir"):
        return "tensorboard"
    if not command.startswith(".venv/bin/relayrl "):
        raise AssertionError(f"README command no rule of tests/integration/test_readme.py runs: {command!r}")
    return "ray" if "executor=ray" in command or "_ray_" in command else "cli"


COMMANDS = commands()


def test_every_readme_command_has_a_rule():
    kinds = [kind_of(c) for c in COMMANDS]
    assert kinds.count("cli") >= 10 and "tensorboard" in kinds
    assert {c for c in COMMANDS if kind_of(c) == "skip"} == set(NOT_HERE)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reader's directory: the repo's configs, and the files the README's commands name."""
    root = tmp_path_factory.mktemp("readme")
    (root / "configs").symlink_to(ROOT / "configs")
    rows = [{"prompt": f"{a}+{b}=", "target": a + b, "answer": str(a + b)} for a in range(10, 30) for b in (1, 2)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "my_rewards.py").write_text(
        "def is_correct(prompts, completions, target, **columns):\n"
        "    return [1.0 if str(t) in c else 0.0 for c, t in zip(completions, target)]\n"
    )
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "my_saved_dataset"))
    return root


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)[1:]  # drop .venv/bin/relayrl
    if argv[0] == "evaluate":  # the README's step_100: the newest checkpoint of a one-step run
        ckpt = Path(argv[argv.index("--checkpoint") + 1])
        newest = max(ckpt.parent.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        argv[argv.index("--checkpoint") + 1] = str(newest)
    if argv[0] == "parity":
        return [*argv, "--steps", "1", *SMALL]
    if argv[0] in ("export", "inspect", "replay") and argv[1].startswith("runs/"):  # the README's step numbers
        newest = _newest_step(Path(argv[1]))  # of a 1000-step run: this one-step run's own
        for flag in ("--step", "--from-step", "--to-step"):
            if flag in argv:
                argv[argv.index(flag) + 1] = str(newest)
    if argv[0] in ("plot", "export", "inspect", "diff", "replay"):
        return argv
    return [*argv, *SMALL]


def _newest_step(run_dir: Path) -> int:
    return max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("command", [c for c in COMMANDS if kind_of(c) in ("cli", "tensorboard")])
def test_readme_command_runs(command, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # the README's, not another test's my_rewards
    if kind_of(command) == "tensorboard":  # the directory exists and holds the run's scalars
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        logdir = Path(shlex.split(command)[2])
        events = EventAccumulator(str(logdir))
        events.Reload()
        assert "train/reward" in events.Tags()["scalars"], logdir
        return
    argv = _argv(command)
    if "--config" in argv and "qwen2.5_0.5b" in argv[argv.index("--config") + 1]:
        argv += CPU_FOR_GPU_CONFIG
    for tracker, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if f"logger.{tracker}_enabled=true" in argv and not _installed(module):  # the README's one-line hint
            assert main(argv) == 2
            assert f"pip install 'relayrl[{tracker}]'" in capsys.readouterr().err
            return
    if "--push-to-hub" in argv:  # no network here: the upload is refused in one line, nothing half-written
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert main(argv) == 2, command
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    if argv[0] == "diff":  # exit 0: identical, 1: where they diverge (two different runs here)
        assert main(argv) == 1, command
        assert "first divergence: step 1" in capsys.readouterr().out
        return
    assert main(argv) == 0, command
    out = capsys.readouterr().out
    if argv[0] == "train" and "--run-dir" not in argv:  # a new run: the README's follow-it line
        assert re.search(r"tensorboard --logdir runs/\d{3}/tensorboard", out), out


@pytest.mark.ray
@pytest.mark.parametrize("command", [c for c in COMMANDS if kind_of(c) == "ray"])
def test_readme_ray_command_runs(command, workdir, monkeypatch, request):
    request.getfixturevalue("ray_cluster")
    monkeypatch.chdir(workdir)
    before = set((workdir / "runs").glob("*"))
    assert main([*shlex.split(command)[1:], *SMALL_RAY]) == 0, command
    # the Ray actors work in another directory than this one: what they write (the policy's checkpointed weights,
    # the recorded rollouts) must still land in the run directory named relative to here
    (run_dir,) = set((workdir / "runs").glob("*")) - before
    step = _newest_step(run_dir)
    assert (run_dir / "checkpoints" / f"step_{step}" / "policy" / "weights" / "model.safetensors").is_file()
    assert (run_dir / "rollouts" / f"step_{step:06d}.parquet").is_file()


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_readme_python_blocks_run(workdir, monkeypatch):
    """The reward example trains (one step), the agents example trains its environment class (one step), and the
    loading example loads the reward example's checkpoint with transformers."""
    monkeypatch.chdir(workdir)
    python_blocks = blocks("python")
    agents_example = next(b for b in python_blocks if "environment_factory" in b)
    reward_example, load_example = [b for b in python_blocks if b is not agents_example]  # exactly these three
    train = relayrl.train

    def small_train(*args, overrides=None, **kwargs):
        return train(*args, overrides={**(overrides or {}), **dict(o.split("=", 1) for o in SMALL)}, **kwargs)

    monkeypatch.setattr(relayrl, "train", small_train)
    scope: dict = {}
    exec(compile(reward_example, "README.md", "exec"), scope)
    result = scope["result"]
    assert result.checkpoint is not None and 0.0 <= result.metrics["train/reward/is_correct"] <= 1.0
    if not (workdir / "my-model").is_dir():  # the README's export command (run by test_readme_command_runs)
        assert main(["export", str(result.run_dir), "--out", "my-model"]) == 0
    scope = {}
    exec(compile(load_example, "README.md", "exec"), scope)
    ids = scope["tokenizer"]("12+3=", return_tensors="pt")["input_ids"]
    assert scope["model"](ids).logits.shape[:2] == ids.shape
    scope = {}
    exec(compile(agents_example, "README.md", "exec"), scope)
    metrics = scope["result"].metrics
    assert metrics["train/env/episodes"] == 8 and 0.0 <= metrics["train/reward/correct"] <= 1.0

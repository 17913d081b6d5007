"""Every mistake a user can make on the command line ends with exactly one line on stderr naming the problem, exit
code 2, and no traceback; and (where it can be known before) before any model is loaded or any run directory is
left behind."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.utils.paths import resolve_model_path

SMALL = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=8"]
SMALL += ["policy.train_micro_batch_size=8", "grpo.max_num_steps=1", "logger.progress_bar=false"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Broken inputs on disk: configs, datasets and model directories."""
    root = tmp_path_factory.mktemp("bad_input")
    model = resolve_model_path("builtin:tiny-arith")
    out = {"root": root}
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "broken.yaml").write_text("grpo: [unclosed\n")
    (root / "a.yaml").write_text("defaults: b.yaml\n")
    (root / "b.yaml").write_text("defaults: a.yaml\n")
    (root / "empty.jsonl").write_text("")
    (root / "rows.csv").write_text("prompt,answer\n1+1,2\n")
    (root / "foo_task.jsonl").write_text(
        "".join(json.dumps({"prompt": "1+1", "answer": "2", "task": "foo"}) + "\n" for _ in range(8))
    )
    (root / "no_answer.jsonl").write_text("".join(json.dumps({"prompt": "1+1"}) + "\n" for _ in range(8)))
    (root / "bad.jinja").write_text("{% for m in messages %}{{ m.content }")
    no_tokenizer = root / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, no_tokenizer / name)
    damaged = root / "damaged"
    shutil.copytree(model, damaged)
    (damaged / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:1000])
    (root / "a_file").write_text("not a model")
    names = (
        "list",
        "broken",
        "a",
        "empty",
        "rows",
        "foo_task",
        "bad",
        "no_tokenizer",
        "damaged",
        "a_file",
        "no_answer",
    )
    for name in names:
        out[name] = next(p for p in root.iterdir() if p.stem == name or p.name == name)
    return out


# (arguments after `relayrl`, words the one line must contain); {name} is a path from `files`
CASES: list[tuple[list[str], str]] = [
    (["train", "foo.bar=1"], "unknown config key: foo"),
    (["train", "grpo.num_prompts_per_step=abc"], "grpo.num_prompts_per_step"),
    (["train", "grpo.num_prompts_per_step=-1"], "grpo.num_prompts_per_step"),
    (["train", "grpo.seed"], "must look like key.subkey=value"),
    (["train", "=3"], "empty key"),
    (["train", "grpo.seed.x=1"], "grpo.seed"),
    (["train", "--config", "{root}/missing.yaml"], "config file not found"),
    (["train", "--config", "{broken}"], "not valid YAML"),
    (["train", "--config", "{list}"], "must hold a mapping"),
    (["train", "--config", "{a}"], "inheritance cycle"),
    (["train", "checkpointing.checkpoint_must_save_by=4h"], "DD:HH:MM:SS"),
    (
        ["train", "grpo.stop_at_validation_metric=acc", "grpo.stop_at_validation_threshold=0.5"],
        "not a validation metric",
    ),
    (["train", "grpo.stop_at_validation_metric=accuracy"], "requires grpo.stop_at_validation_threshold"),
    (
        [
            "train",
            "grpo.num_generations_per_prompt=1",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=16",
        ],
        "num_generations_per_prompt must be >= 2",
    ),
    (["train", "grpo.advantage_clip_low=1", "grpo.advantage_clip_high=-1"], "advantage_clip_low"),
    (["train", "loss_fn.use_kl_in_reward=true"], "loss_fn.use_kl_in_reward=true with grpo.adv_estimator.name='grpo'"),
    (  # the legacy trainer took the in-reward KL against zeros, the data-plane one dropped it (NeMo RL refuses)
        ["train", "loss_fn.use_kl_in_reward=true", "loss_fn.force_on_policy_ratio=true", "algorithm=ppo"],
        "skips the previous-log-prob pass that loss_fn.use_kl_in_reward=true needs",
    ),
    (["train", "algorithm=ppo", "reward_penalties.malformed_thinking_advantage=-1"], "applies to GRPO only"),
    (["train", "algorithm=ppo", "value.tokenizer.name=x"], "value.tokenizer is not used"),
    (["train", "data_plane.storage_capacity=10"], "data_plane.storage_capacity"),
    (["train", "grpo.batch_multiplier=2"], "batch_multiplier must be 1"),
    (["train", "policy.train_micro_batch_size=100"], "not divisible by policy.train_micro_batch_size"),
    (
        ["train", "policy.train_global_batch_size=100", "policy.train_micro_batch_size=100"],
        "not divisible by policy.train_global_batch_size",
    ),
    (["train", "checkpointing.metric_name=accuracy"], "must start with 'val:' or 'train:'"),
    (["train", "grpo.skip_reference_policy_logprobs_calculation=true"], "reference_policy_kl_penalty"),
    (["train", "policy.generation.max_new_tokens=64"], "max_new_tokens must be <"),
    (["train", "data.train.source=file"], "data.train.path is required"),
    (["train", "cluster.executor=ray", "data_plane.backend=memory"], "data_plane.backend=memory"),
    (["train", *SMALL, "cluster.device=cuda"], "cluster.device asks for CUDA"),
    (["train", *SMALL, "policy.tokenizer.chat_template={root}/missing.jinja"], "chat_template file does not exist"),
    (["train", *SMALL, "policy.tokenizer.chat_template={bad}"], "Jinja syntax error"),
    (["train", *SMALL, "policy.generation.stop_token_ids=[100000]"], "outside the vocabulary"),
    (["train", *SMALL, "policy.max_total_sequence_length=100000"], "exceeds the model's position limit"),
    (["train", *SMALL, "data.train.source=file", "data.train.path={root}/missing.jsonl"], "does not exist"),
    (["train", *SMALL, "data.train.source=file", "data.train.path={empty}"], "is empty"),
    (["train", *SMALL, "data.train.source=file", "data.train.path={rows}"], "unsupported dataset file extension"),
    (["train", *SMALL, "data.train.source=file", "data.train.path={foo_task}"], "'foo' with no environment"),
    (["train", *SMALL, "policy.model_name={root}/missing_model"], "model path does not exist"),
    (["train", *SMALL, "policy.model_name={a_file}"], "model path is not a directory"),
    (["train", *SMALL, "policy.model_name={no_tokenizer}"], "has no tokenizer files"),
    (["train", *SMALL, "policy.model_name={damaged}"], "its weights could not be loaded"),
    (["train", *SMALL, "data.train.source=file", "data.train.path={no_answer}"], "missing answer field 'answer'"),
    (["train", "data.train.source=hf"], "data.train.path is required when data.train.source is 'hf'"),
    (["train", *SMALL, "data.train.source=python"], "pass relayrl.train(train_dataset=...)"),
    (["train", "env.reward_fns=[rewards]"], "must look like module:function"),
    (["train", "env.reward_fns=[a:f]", "env.reward_weights=[1, 2]"], "2 weights for 1 env.reward_fns"),
    (["train", *SMALL, "env.reward_fns=[no_such_module_xyz:f]"], "no module named 'no_such_module_xyz'"),
    (["train", *SMALL, "env.reward_fns=[{root}/missing.py:f]"], "does not exist"),
    (["train", *SMALL, "data.train.default_task=reward_fns"], "need reward functions"),
    (["config", "show", "grpo.nope=1"], "unknown config key: grpo.nope"),
    (["evaluate", "--checkpoint", "{root}/missing_ckpt"], "checkpoint directory does not exist"),
    (["parity", "--steps", "0"], "--steps must be >= 1"),
]
if importlib.util.find_spec("wandb") is None:
    CASES.append((["train", *SMALL, "logger.wandb_enabled=true"], "needs the wandb package"))


@pytest.mark.parametrize(("argv", "expected"), CASES, ids=[" ".join(a[-1:]) or a[0] for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, expected, files, tmp_path, capsys):
    paths = {k: str(v) for k, v in files.items()}
    argv = [a.format(**paths) for a in argv]
    run_dir = tmp_path / "run"
    if argv[0] == "train":
        argv = [argv[0], "--run-dir", str(run_dir), *argv[1:]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("Writing model shards")]
    assert len(err) == 1 and err[0].startswith("relayrl: error: "), err
    assert expected in err[0], err[0]
    assert not run_dir.exists(), "a failed set-up left a run directory behind"


def test_the_table_covers_at_least_thirty_mistakes():
    assert len(CASES) >= 30


def test_a_failed_set_up_leaves_no_numbered_run_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL, f"policy.model_name={tmp_path}/missing_model"]) == 2
    assert "model path does not exist" in capsys.readouterr().err
    assert not any(p.name.isdigit() for p in (tmp_path / "runs").iterdir()), "runs/NNN left behind"

"""`pip install -e .` alone is a working CPU trainer: the packages the extras bring (Ray, pyzmq, TransferQueue,
datasets, trackers, dev tools) are never imported by a local run, and the base dependencies do not list them."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Import names of what only the extras install.
EXTRA_MODULES = ("ray", "zmq", "transfer_queue", "datasets", "wandb", "mlflow", "pytest", "hypothesis", "trl")

BLOCKED_RUN = """
import sys
for name in {modules!r}:
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
from relayrl.cli.main import main
small = ["logger.progress_bar=false", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8"]
grpo = small + ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2"]
assert main(["train", "--run-dir", sys.argv[1] + "/grpo", *grpo]) == 0
ppo = small + ["value.train_global_batch_size=8", "value.train_micro_batch_size=8", "ppo.num_prompts_per_step=8"]
ppo += ["ppo.max_num_steps=1", "ppo.max_val_samples=8", "ppo.val_batch_size=8"]
assert main(["train", "--config", {ppo_config!r}, "--run-dir", sys.argv[1] + "/ppo", *ppo]) == 0
print("trained without", sorted(k for k, v in sys.modules.items() if v is None))
"""


def test_base_dependencies_leave_the_extras_out():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert {"torch", "transformers", "pydantic"} <= base
    not_base = {"ray", "pyzmq", "transferqueue", "datasets", "pytest", "hypothesis", "mypy", "ruff", "wandb"}
    assert not base & (not_base | {"accelerate", "tokenizers"}), base & not_base  # the last two: never imported
    extras = project["optional-dependencies"]
    assert {"ray", "transfer_queue", "wandb", "mlflow", "dev", "bench", "datasets"} <= set(extras)
    assert any(d.startswith("pyzmq") for d in extras["ray"])


def test_grpo_and_ppo_train_on_cpu_without_any_extra(tmp_path):
    code = BLOCKED_RUN.format(modules=EXTRA_MODULES, ppo_config=str(ROOT / "configs" / "ppo_arith_tiny.yaml"))
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained without" in out.stdout
    assert (tmp_path / "grpo" / "checkpoints" / "step_2").is_dir() and (tmp_path / "ppo" / "metrics.jsonl").is_file()

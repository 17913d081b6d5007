"""What refit verification (`policy.generation.refit_verify`, default enforce) costs (issue 28: at most 2% of a
default step).

Two measures, side by side in one run:

1. The default run (shipped model, 16 prompts x 8 generations, data-plane trainer) trains `--steps` steps without
   validation with `refit_verify=enforce` and with `off`, rounds alternating the order so that load from other
   processes hits both alike; each run is a fresh subprocess and drops its first `--warmup` steps. Reported: the
   median `timing/train/total_step_time` of each and their ratio (this includes run-to-run noise).
2. The check itself, timed directly: the engine's digests plus the policy's digests (what every generation phase
   adds). On the default run's path (the local executor's engine reads the trainer's tensors in place: nothing to
   compare in float32, its bf16 copies of the projections under bf16), and with every tensor digested on both
   sides (generation workers refitted by IPC or a collective) for the shipped and the 25M model; median over
   `--repeats`, in milliseconds and as a share of measure 1's median step. Timed on one torch thread:
   on a loaded 2-core box two threads spin at every op's barrier while the other is descheduled, which turns the
   check's ~300 small reductions from milliseconds into hundreds of them (measured); one thread shows the work.

    HF_HUB_OFFLINE=1 python bench/refit_verify.py [--steps 20] [--rounds 2] [--warmup 3] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import WIDE_25M  # bench/model_shapes.py

from relayrl.config import GenerationConfig
from relayrl.config.base import BUILTIN_TINY_MODEL
from relayrl.distributed.refit_digest import expected_digests
from relayrl.models.generation.digests import verify_engine
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.tiny import build_char_tokenizer, build_tiny_qwen2, count_parameters
from relayrl.utils.paths import resolve_model_path


def step_times(run_dir: Path, steps: int, mode: str) -> list[float]:
    argv = [
        sys.executable, "-m", "relayrl.cli.main", "train", "--run-dir", str(run_dir),
        f"grpo.max_num_steps={steps}", "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0",
        "checkpointing.enabled=false", "logger.tensorboard_enabled=false", "logger.progress_bar=false",
        f"policy.generation.refit_verify={mode}",
    ]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["timing/train/total_step_time"] for r in rows if "timing/train/total_step_time" in r]


class _Source:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.weights_version = model, 0


def check_ms(model: torch.nn.Module, tokenizer: object, precision: str, repeats: int, in_place: bool) -> float:
    """Median milliseconds of one verification: the engine's digests and the trainer's under the same keys.
    `in_place`: the local executor's engine, which reads the trainer's own tensors (only its bf16 copies are
    compared); else every tensor is digested on both sides, as for generation workers refitted by IPC or a collective."""
    engine = HfGeneration(GenerationConfig(), tokenizer, _Source(model), precision=precision)
    trainer = list(model.state_dict().items())
    if in_place:
        engine.trainer_storage = lambda: {t.data_ptr() for _, t in trainer}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        verify_engine(engine.weight_digests, lambda keys: expected_digests(trainer, keys), "enforce", 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    steps: dict[str, list[float]] = {"enforce": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("enforce", "off") if r % 2 == 0 else ("off", "enforce"):
                steps[mode] += step_times(Path(tmp) / f"r{r}_{mode}", args.steps, mode)[args.warmup :]
    on, off = statistics.median(steps["enforce"]), statistics.median(steps["off"])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    shipped_dir = resolve_model_path(BUILTIN_TINY_MODEL)
    torch.set_num_threads(1)
    shipped = AutoModelForCausalLM.from_pretrained(shipped_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(shipped_dir)
    wide = build_tiny_qwen2(len(build_char_tokenizer()), seed=1, **WIDE_25M).eval()  # type: ignore[arg-type]
    n_shipped, n_wide = count_parameters(shipped) / 1e6, count_parameters(wide) / 1e6
    checks = {
        f"default run, in place ({n_shipped:.1f}M) float32": check_ms(shipped, tokenizer, "float32", args.repeats, True),
        f"default run, in place ({n_shipped:.1f}M) bfloat16": check_ms(shipped, tokenizer, "bfloat16", args.repeats, True),
        f"every tensor ({n_shipped:.1f}M) float32": check_ms(shipped, tokenizer, "float32", args.repeats, False),
        f"every tensor ({n_wide:.1f}M) float32": check_ms(wide, build_char_tokenizer(), "float32", args.repeats, False),
    }  # fmt: skip
    result = {
        "kept_steps_per_side": len(steps["off"]),
        "median_step_s_verify_enforce": round(on, 4),
        "median_step_s_verify_off": round(off, 4),
        "step_time_ratio_enforce_over_off": round(on / off, 4),
        "check_ms": {k: round(v, 2) for k, v in checks.items()},
        "check_share_of_default_step": round(next(iter(checks.values())) / 1e3 / off, 4),
        "bf16_check_share_of_default_step": round(list(checks.values())[1] / 1e3 / off, 4),
        "every_tensor_check_share_of_default_step": round(list(checks.values())[2] / 1e3 / off, 4),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The GPU check's training run and report (`scripts/gpu_check.sh` runs it on a lent H100/H200, which has no internet).

It builds a randomly initialised model of Qwen2.5-0.5B's shape (configs/gpu/qwen2.5-0.5b-shape.json) with the shipped
tiny-arith tokenizer - ids past its 103 tokens decode to nothing, so the run measures speed and memory, not learning -
trains it for a few steps of bf16 GRPO from the single-GPU example config, and prints tokens/s, the step-time
breakdown, MFU and peak device memory; the same figures go to `<out>/gpu_check.json` for the README.

MFU counts the model's matrix FLOPs only (2 per parameter per token forward, 6 forward and backward; attention's
sequence-length term left out, small at these lengths): training over the `policy_training` phase, and the whole step
(generation, the old-policy and reference passes, training) over the step's time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ROOT / "configs" / "gpu" / "qwen2.5-0.5b-shape.json"
TOKENIZER = ROOT / "relayrl" / "assets" / "tiny-arith"
CONFIG = ROOT / "configs" / "qwen2.5_0.5b_instruct_grpo.yaml"
#: Dense bf16 tensor-core peaks (FLOP/s) by the device name's model; others: --peak-tflops.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
WARMUP_STEPS = 2  # the first steps pay allocation and kernel selection; medians over the rest


def build_model(out: Path, seed: int) -> int:
    """A random Qwen2.5-0.5B-shaped model saved with the tiny tokenizer; returns its parameter count."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config.from_json_file(SHAPE), dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, out / name)
    return sum(p.numel() for p in model.parameters())  # tied embeddings counted once


def peak_flops(name: str, given: float | None) -> float:
    if given:
        return given * 1e12
    for model, flops in PEAK_BF16.items():
        if model in name:
            return flops
    raise SystemExit(f"no bf16 peak known for {name!r}: pass --peak-tflops")


def report(run_dir: Path, params: int, peak: float) -> dict[str, Any]:
    """Medians over the steps after the warm-up, from the run's metrics.jsonl."""
    by_step: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(int(row["step"]), {}).update(row)
    steps = [m for s, m in sorted(by_step.items()) if s > WARMUP_STEPS and "timing/train/total_step_time" in m]
    if not steps:
        raise SystemExit(f"{run_dir}: no step after the {WARMUP_STEPS} warm-up steps was logged")

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps)

    step_s, tokens = med("timing/train/total_step_time"), med("train/total_num_tokens")
    rows = med("train/total_num_tokens") / max(med("train/mean_total_tokens_per_sample"), 1.0)
    gen_tokens = med("train/mean_gen_tokens_per_sample") * rows
    passes = sum(1 for p in ("prev_logprobs", "reference") if med(f"timing/train/{p}") > 0)
    step_flops = 2 * params * gen_tokens + 2 * params * tokens * passes + 6 * params * tokens
    phases = {
        k.removeprefix("timing/train/"): med(k)
        for k in sorted({k for m in steps for k in m})
        if k.startswith("timing/train/") and k.count("/") == 2 and k != "timing/train/total_step_time"
    }
    return {
        "steps_measured": len(steps),
        "params": params,
        "step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": med("performance/tokens_per_sec"),
        "generated_tokens_per_s": gen_tokens / max(med("timing/train/generation"), 1e-9),
        "mfu_training": 6 * params * tokens / max(med("timing/train/policy_training"), 1e-9) / peak,
        "mfu_step": step_flops / step_s / peak,
        "phases_s": {k: v for k, v in phases.items() if v >= 5e-4},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the model, the run and gpu_check.json go")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="a random model rarely stops early")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script's plumbing")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("overrides", nargs="*", help="dotted overrides after the check's own (e.g. sizes)")
    args = parser.parse_args(argv)

    import relayrl

    args.out.mkdir(parents=True, exist_ok=True)
    params = build_model(args.out / "model", seed=0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = peak_flops(name, args.peak_tflops if args.device == "cuda" else args.peak_tflops or 1.0)
    overrides = {
        "policy.model_name": str(args.out / "model"),
        "grpo.max_num_steps": args.steps,
        "grpo.val_period": 0,
        "grpo.val_at_start": False,
        "grpo.val_at_end": False,
        "checkpointing.enabled": False,
        "logger.progress_bar": False,
        "policy.generation.max_new_tokens": args.max_new_tokens,
        "cluster.device": args.device,
    }
    overrides.update(dict(o.split("=", 1) for o in args.overrides))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    shutil.rmtree(args.out / "run", ignore_errors=True)  # an earlier check's metrics must not enter the medians
    result = relayrl.train(config=str(CONFIG), run_dir=args.out / "run", overrides=overrides)
    figures = report(result.run_dir, params, peak)
    figures["device"] = name
    if args.device == "cuda":
        figures["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        figures["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    (args.out / "gpu_check.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\n{name}: {params / 1e6:.0f}M parameters, {args.steps} bf16 GRPO steps, medians after {WARMUP_STEPS}")
    print(
        f"  step {figures['step_s']:.2f} s, {figures['tokens_per_s']:.0f} tokens/s, {figures['tokens_per_step']:.0f} a step"
    )
    print(f"  generation {figures['generated_tokens_per_s']:.0f} generated tokens/s")
    print(f"  MFU: training {figures['mfu_training']:.1%}, whole step {figures['mfu_step']:.1%}")
    if "peak_memory_gib" in figures:
        print(
            f"  peak memory {figures['peak_memory_gib']:.1f} GiB allocated, {figures['peak_reserved_gib']:.1f} reserved"
        )
    for phase, seconds in sorted(figures["phases_s"].items(), key=lambda kv: -kv[1]):
        print(f"    {phase:<24} {seconds:8.3f} s  {seconds / figures['step_s']:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

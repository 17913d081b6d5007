"""Memory and checkpoint size of LoRA vs full fine-tuning: the same short GRPO run, once per mode, side by side.

Why: LoRA's promise is a smaller training footprint (no gradients or Adam moments for the base weights, no second
frozen copy for the reference policy) and small checkpoints (adapters and their optimizer state only). Each mode
runs in its own process (`--child`), so peak RSS (`ru_maxrss`) is that mode's alone; it is reported as is and above
the process's RSS once torch, transformers and peft are imported (the fixed cost both modes pay). The model-state
bytes are counted from the live tensors after training: weights, Adam moments, the reference copy, and the
weights the colocated generation engine reads when they are not the policy's own (LoRA: the merged weights of the
adapted projections; its other tensors are the policy's);
gradients are freed after each step and show up in the peak only. On a CUDA device (`--device cuda`) the peak of
torch's allocator is reported too.

The model is the shipped model's architecture scaled up (`--hidden`, `--layers`), with random weights
(`policy.random_init`): large enough that model state, not the Python runtime, dominates memory.

    HF_HUB_OFFLINE=1 python bench/lora_vs_full.py                    # hidden 512, 8 layers (~26M parameters)
    HF_HUB_OFFLINE=1 python bench/lora_vs_full.py --hidden 256 --layers 4 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _rss_mib() -> float:
    """Current resident set size of this process, MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _tensor_mib(tensors: Any, exclude: Any = ()) -> float:
    """Bytes of distinct storages among `tensors`, MiB (tied weights count once), leaving out the storages of
    `exclude` (tensors shared with another module count there)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    for t in tensors:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values()) / 2**20


def _dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def overrides(args: argparse.Namespace, mode: str) -> list[str]:
    heads = max(1, args.hidden // 64)
    model = {
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "layer_types": ["full_attention"] * args.layers,
    }
    return [
        "policy.random_init=true",
        f"policy.hf_config_overrides={json.dumps(model)}",
        f"policy.lora.enabled={str(mode == 'lora').lower()}",
        f"policy.lora.rank={args.rank}",
        f"grpo.max_num_steps={args.steps}",
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=8",
        "policy.generation.max_new_tokens=16",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.val_period=0",
        f"checkpointing.save_period={args.steps}",
        "logger.progress_bar=false",
        "logger.tensorboard_enabled=false",
        "logger.num_train_samples_to_log=0",
        f"cluster.device={args.device}",
    ]


def child(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One run in this process; returns its measurements."""
    import peft  # noqa: F401 - imported by both modes, so the baseline is the same
    import torch
    import transformers  # noqa: F401

    from relayrl.algorithms import setup as setup_mod
    from relayrl.utils.config_io import load_config

    baseline = _rss_mib()
    run_dir = Path(args.workdir) / mode
    cfg = load_config(None, overrides(args, mode))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    c = setup_mod.setup(cfg, run_dir)
    try:
        setup_mod.train_components(cfg, c)  # the trainer run_training would pick, with the policy kept alive afterwards
        worker = c.policy._group.worker(0)
        model = worker.model
        opt_state = [t for st in worker.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        reference = worker.reference_model
        view = worker.generation_view
        generation_copy = view.model if view is not worker else None
        state = {
            "weights": _tensor_mib(list(model.parameters()) + list(model.buffers())),
            "adam_moments": _tensor_mib(opt_state),
            "reference_copy": _tensor_mib(reference.parameters()) if reference is not None else 0.0,
            "generation_copy": 0.0
            if generation_copy is None
            else _tensor_mib(generation_copy.parameters(), exclude=model.parameters()),
        }
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None
    finally:
        c.close()
    step = run_dir / "checkpoints" / f"step_{args.steps}"
    return {
        "mode": mode,
        "parameters": total,
        "trainable": trainable,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "baseline_rss_mib": baseline,
        "model_state_mib": state,
        "cuda_peak_allocated_mib": cuda_peak,
        "checkpoint_mib": {
            "policy_weights": _dir_mib(step / "policy" / "weights"),
            "policy_optimizer": _dir_mib(step / "policy" / "optimizer"),
            "step_dir": _dir_mib(step),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--workdir", help="where the runs go (default: a temporary directory)")
    p.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args, args.child)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for mode in ("full", "lora"):
            argv = [sys.executable, __file__, "--child", mode, "--workdir", args.workdir or tmp]
            argv += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--rank", str(args.rank)]
            argv += ["--steps", str(args.steps), "--device", args.device]
            out = subprocess.run(argv, capture_output=True, text=True, check=False)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not lines:
                sys.exit(f"{mode} run failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    report(results)


def report(results: list[dict[str, Any]]) -> None:
    full, lora = results
    rows: list[tuple[str, Any, Any]] = [
        ("parameters", full["parameters"], lora["parameters"]),
        ("trainable parameters", full["trainable"], lora["trainable"]),
    ]
    for key in full["model_state_mib"]:
        rows.append((f"model state: {key} (MiB)", full["model_state_mib"][key], lora["model_state_mib"][key]))
    rows.append(
        ("model state: total (MiB)", sum(full["model_state_mib"].values()), sum(lora["model_state_mib"].values()))
    )
    rows.append(("peak RSS (MiB)", full["peak_rss_mib"], lora["peak_rss_mib"]))
    rows.append(
        (
            "peak RSS above imports (MiB)",
            full["peak_rss_mib"] - full["baseline_rss_mib"],
            lora["peak_rss_mib"] - lora["baseline_rss_mib"],
        )
    )
    if full["cuda_peak_allocated_mib"] is not None:
        rows.append(("CUDA peak allocated (MiB)", full["cuda_peak_allocated_mib"], lora["cuda_peak_allocated_mib"]))
    for key in full["checkpoint_mib"]:
        rows.append((f"checkpoint: {key} (MiB)", full["checkpoint_mib"][key], lora["checkpoint_mib"][key]))
    print(f"{'':36} {'full':>12} {'lora':>12} {'lora/full':>10}")
    for name, a, b in rows:
        ratio = f"{b / a:10.3f}" if a else f"{'':10}"
        fmt = (lambda v: f"{v:12,d}") if isinstance(a, int) else (lambda v: f"{v:12.1f}")
        print(f"{name:36} {fmt(a)} {fmt(b)} {ratio}")


if __name__ == "__main__":
    main()

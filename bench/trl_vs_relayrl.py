"""relayrl's GRPO step time against TRL's GRPOTrainer on one identical CPU set-up (issue 3, item 8).

Why: the acceptance bar is "relayrl at least twice as fast as TRL" (median step-time ratio relayrl/TRL <= 0.5) on
the workload of `shared/reference/peers.md` section B, so both trainers must do the same work per step.

Set-up shared by both: a random Qwen2 (hidden 128, 2 layers, 4 heads / 4 KV heads, intermediate 512, tied
embeddings) with relayrl's character tokenizer, saved once to a temporary directory and loaded by path by each
trainer (policy and reference copy); arithmetic prompts rendered with the chat template; 8 prompts x 4 generations
per step; <= 64 new tokens; temperature 1; KL coefficient 0.04 with a reference model; AdamW, lr 1e-5, constant
schedule, grad-norm clip 1.0; fp32; 1 torch thread; no gradient checkpointing; no validation, checkpointing or
per-step logging in TRL's loop (relayrl writes its own metrics.jsonl line per step, which it always does). The
reward is relayrl's `MathEnvironment.step` on both sides (exact `\\boxed{}` check).
Each side runs its own defaults beyond that: relayrl decodes through its compiled CPU step (built, or found in
its cache, before the first round), TRL through `model.generate`.

Step time = wall clock from the end of one optimizer step to the end of the next, on both sides (TRL: callback
`on_step_end`; relayrl: the moment the loop logs the step's timing metrics), so each covers data fetch,
generation, reward, reference/old log-probs, advantages and the update. Each round runs TRL, then relayrl, each in
a fresh subprocess; the first `--warmup` steps of every run are discarded.

Run (about 2.5 minutes on a quiet 2-core CPU, up to 5 when the box is shared):

    HF_HUB_OFFLINE=1 python bench/trl_vs_relayrl.py --steps 20 --rounds 2
    HF_HUB_OFFLINE=1 python bench/trl_vs_relayrl.py --steps 6 --rounds 1 --model-size 25m   # ~25M parameters

`--relayrl-override KEY=VALUE` (repeatable) adds relayrl config overrides, e.g. to measure a candidate speed-up.
Besides wall time, both sides report CPU seconds per step and per phase, which a shared box disturbs far less.

The fp32 floor line says how far any implementation of relayrl's step could go here: the step's linear-layer
matmul FLOPs (generation, reference pass, forward + backward) divided by two cores at the single-core matmul
throughput measured before the rounds. At 25M parameters the step is compute-bound, so a ratio to TRL below the
floor's cannot be reached in float32 on this machine, whatever the scheduling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from model_shapes import WIDE_25M  # bench/model_shapes.py

NUM_PROMPTS, NUM_GENERATIONS, MAX_NEW_TOKENS = 8, 4, 64
KL_BETA, SEED = 0.04, 42


# ---------------------------------------------------------------------------------------------------- shared
#: `--model-size`: `tiny` is build_tiny_qwen2's defaults (hidden 128, 4 heads, 4 KV heads, MLP 512, tied
#: embeddings) with 2 layers (~0.56M parameters); `25m` widens it (hidden 512, 6 layers, 8 heads, MLP 2048).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=2),
    "25m": WIDE_25M,
}


def build_model_dir(path: Path, size: str = "tiny") -> int:
    """Save the random Qwen2 of `size` + char tokenizer once; returns the parameter count."""
    from relayrl.models.tiny import build_char_tokenizer, build_tiny_qwen2, count_parameters, save_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(len(tokenizer), seed=SEED, **MODEL_SIZES[size])  # type: ignore[arg-type]
    save_tiny_model(path, model, tokenizer)
    return count_parameters(model)


def matmul_flops_per_token(model_dir: str) -> tuple[float, int]:
    """(FLOPs of one token's linear-layer matmuls in a forward pass: 2 x the weights of every projection and the LM
    head, mean prompt tokens of the bench's chat-templated prompts). Attention scores, norms and activations are left
    out: at these lengths they are a few percent, so the floor below is a lower bound."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relayrl.experience.arithmetic import all_problems, split_problems

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, _ = split_problems(all_problems(), num_val=200)
    msgs = [[{"role": "user", "content": p.problem}] for p in train[:256]]
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    lengths = [len(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]  # as relayrl's data
    return 2.0 * weights, round(statistics.mean(lengths))


def gemm_peak_gflops(hidden: int, seconds: float = 1.0) -> float:
    """One core's float32 matmul throughput, measured now on a [2048, hidden] x [hidden, 4 hidden] product (the
    shape of a training pass's MLP projection), best of a few timed runs."""
    import torch

    torch.set_num_threads(1)
    a, w = torch.randn(2048, hidden), torch.randn(4 * hidden, hidden)
    flops, best = 2.0 * a.shape[0] * hidden * w.shape[0], 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(4):
            torch.nn.functional.linear(a, w)
        best = max(best, 4 * flops / (time.perf_counter() - t))
    return best / 1e9


def fp32_floor(flops_per_token: float, prompt_tokens: int, gen_tokens: float, peak: float, cores: int = 2) -> float:
    """Seconds per step below which no fp32 implementation of relayrl's step can go on `cores` cores at `peak`
    GFLOPS each: generation (one forward per generated token), the reference pass (one forward over the step's
    distinct tokens: each prompt once, every completion) and training (forward + backward, three forwards' worth)."""
    distinct = NUM_PROMPTS * prompt_tokens + gen_tokens
    return flops_per_token * (gen_tokens + 4 * distinct) / (cores * peak * 1e9)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class StepMeter:
    """Per-step wall and CPU seconds, plus CPU seconds of named phases (CPU time is robust to a busy box)."""

    def __init__(self) -> None:
        self.rec: dict[str, Any] = {"step_s": [], "cpu_s": [], "gen_tokens": [], "cpu_phases": []}
        self._acc: dict[str, float] = {}
        self._last = (time.perf_counter(), time.process_time())

    def start(self) -> None:
        self._last, self._acc = (time.perf_counter(), time.process_time()), {}

    def end_step(self) -> None:
        now = (time.perf_counter(), time.process_time())
        self.rec["step_s"].append(now[0] - self._last[0])
        self.rec["cpu_s"].append(now[1] - self._last[1])
        self.rec["cpu_phases"].append({**self._acc, "step": now[1] - self._last[1]})
        self._last, self._acc = now, {}

    def wrap(self, obj: Any, name: str, phase: str, after: Any = None) -> None:
        """Replace `obj.name` (on the instance) by a CPU-timed call; `after(result)` may read the result."""
        fn = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.process_time()
            out = fn(*args, **kwargs)
            self._acc[phase] = self._acc.get(phase, 0.0) + time.process_time() - t
            if after is not None:
                after(out)
            return out

        setattr(obj, name, timed)


# ---------------------------------------------------------------------------------------------------- TRL worker
def run_trl(model_dir: str, total_steps: int, lr: float, work_dir: Path, threads: int = 1) -> dict[str, Any]:
    """TRL GRPOTrainer with `threads` torch threads; per-step wall time, rollout/sampling phase time, tokens."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.environments.math_env import MathEnvironment
    from relayrl.experience.arithmetic import all_problems, split_problems

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, _ = split_problems(all_problems(), num_val=200)
    rows = [
        {
            "prompt": tokenizer.apply_chat_template(
                [{"role": "user", "content": p.problem}], tokenize=False, add_generation_prompt=True
            ),
            "answer": p.answer,
        }
        for p in train
    ]
    env = MathEnvironment()

    def math_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        """relayrl's own environment step (the call its rollout makes), so both sides score identically."""
        logs = [[{"role": "assistant", "content": c}] for c in completions]
        return env.step(logs, [{"ground_truth": a} for a in answer]).rewards.tolist()

    meter = StepMeter()

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            meter.start()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            meter.end_step()

    args = GRPOConfig(
        output_dir=str(work_dir / "trl_out"),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        max_steps=total_steps,
        per_device_train_batch_size=NUM_PROMPTS * NUM_GENERATIONS,
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        beta=KL_BETA,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=SEED,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[math_reward],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    # rollout = sampling + reward + reference log-probs + advantages; train = the rest of the step.
    count = lambda out: meter.rec["gen_tokens"].append(float(out["completion_mask"].sum()))  # noqa: E731
    meter.wrap(trainer, "_generate_and_score_completions", "rollout", after=count)
    meter.wrap(trainer, "_generate_single_turn", "generation")
    try:
        trainer.train()
    finally:
        env.shutdown()
    return meter.rec


# ---------------------------------------------------------------------------------------------------- relayrl worker
def relayrl_overrides(model_dir: str, total_steps: int, lr: float) -> list[str]:
    """The same set-up as TRL's, spelled as relayrl config overrides."""
    return [
        f"policy.model_name={model_dir}",
        f"grpo.num_prompts_per_step={NUM_PROMPTS}",
        f"grpo.num_generations_per_prompt={NUM_GENERATIONS}",
        f"grpo.max_num_steps={total_steps}",
        f"grpo.seed={SEED}",
        f"policy.train_global_batch_size={NUM_PROMPTS * NUM_GENERATIONS}",
        f"policy.train_micro_batch_size={NUM_PROMPTS * NUM_GENERATIONS}",
        f"policy.generation.max_new_tokens={MAX_NEW_TOKENS}",
        "policy.generation.temperature=1.0",
        "policy.max_total_sequence_length=128",
        "policy.precision=float32",
        "policy.activation_checkpointing=false",
        f"loss_fn.reference_policy_kl_penalty={KL_BETA}",
        f"policy.optimizer.kwargs.lr={lr}",
        "policy.scheduler.name=constant",
        "policy.max_grad_norm=1.0",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "logger.num_train_samples_to_log=0",
        "cluster.torch_num_threads=1",
        "cluster.device=cpu",
    ]


#: `--relayrl-trainer`: the overrides that select each trainer (legacy: grpo_train, driver-held batches; sync: the
#: data-plane trainer; async: the data-plane trainer with generation one step ahead, max_trajectory_age_steps=1, its
#: engine in a child process with its own thread, so relayrl has the machine's 2 cores as TRL with 2 threads has).
TRAINERS: dict[str, list[str]] = {
    "legacy": ["data_plane.enabled=false"],
    "sync": ["data_plane.enabled=true"],
    "async": ["data_plane.enabled=true", "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1"],
}


def run_relayrl(
    model_dir: str, total_steps: int, lr: float, work_dir: Path, extra: list[str] | None = None, trainer: str = "legacy"
) -> dict[str, Any]:
    """relayrl through its public set-up and the trainer the config selects; step ends are taken when the loop
    logs `timing/train`. The legacy trainer's engine and policy calls are CPU-timed by phase as well."""
    import torch

    from relayrl.algorithms.setup import setup, train_components
    from relayrl.utils.config_io import load_config

    torch.set_num_threads(1)
    cfg = load_config(None, relayrl_overrides(model_dir, total_steps, lr) + TRAINERS[trainer] + list(extra or []))
    run_dir = work_dir / "relayrl_run"
    c = setup(cfg, run_dir)
    meter = StepMeter()
    log_metrics = c.logger.log_metrics

    def clocked(metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        if prefix == "timing/train":
            meter.end_step()
        log_metrics(metrics, step, prefix=prefix)

    c.logger.log_metrics = clocked
    if trainer == "legacy":  # the async producer has its own engine (in another process): phases come from metrics
        meter.wrap(c.policy_generation, "generate", "generation")
        meter.wrap(c.policy, "get_logprobs", "logprobs")
        meter.wrap(c.policy, "get_reference_policy_logprobs", "logprobs")
        meter.wrap(c.policy, "train", "train")
    meter.start()
    try:
        train_components(cfg, c)
    finally:
        c.close()
    by_step: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            by_step.setdefault(int(row["step"]), {}).update(row)
    steps = [by_step[s] for s in sorted(by_step)]
    meter.rec["gen_tokens"] = [_gen_tokens(r) for r in steps]
    meter.rec["phases"] = {k: [float(r[k]) for r in steps if k in r] for k in _timing_keys(steps)}
    return meter.rec


def _timing_keys(steps: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in steps for k in r if k.startswith("timing/train/")})


def _gen_tokens(row: dict[str, Any]) -> float:
    """Generated tokens in the step, from the rollout metrics (mean per sample x samples)."""
    value = row.get("train/mean_gen_tokens_per_sample")
    return float("nan") if value is None else float(value) * NUM_PROMPTS * NUM_GENERATIONS


# ---------------------------------------------------------------------------------------------------- driver
def run_worker(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"bench_{args.worker}_") as tmp:
        total = args.steps + args.warmup
        if args.worker == "trl":
            rec = run_trl(args.model_dir, total, args.lr, Path(tmp), args.threads)
        else:
            rec = run_relayrl(args.model_dir, total, args.lr, Path(tmp), args.relayrl_override, args.relayrl_trainer)
    rec["load_start"], rec["load_end"] = load, os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(rec))


def spawn(kind: str, model_dir: str, args: argparse.Namespace, out: Path, threads: int = 1) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--worker", kind, "--model-dir", model_dir, "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr), "--threads", str(threads)]
    cmd += ["--relayrl-trainer", args.relayrl_trainer]
    for item in args.relayrl_override:
        cmd += ["--relayrl-override", item]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{kind} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _steady(runs: list[dict[str, Any]], key: str, warmup: int) -> list[float]:
    """Every run's values after its warm-up steps, pooled."""
    return [x for r in runs for x in r[key][warmup:]]


def _cpu_phase_rows(runs: list[dict[str, Any]], warmup: int, trl: bool) -> list[dict[str, float]]:
    """Per steady step: CPU seconds of generation, scoring + log-prob passes, training and the rest."""
    out = []
    for ph in (p for r in runs for p in r["cpu_phases"][warmup:]):
        gen, step = ph.get("generation", 0.0), ph["step"]
        if trl:  # TRL's rollout covers sampling, reward, reference log-probs and advantages; the rest is training
            row = {"generation": gen, "logprobs": ph.get("rollout", 0.0) - gen, "train": step - ph.get("rollout", 0.0)}
            row["other"] = 0.0
        else:
            row = {"generation": gen, "logprobs": ph.get("logprobs", 0.0), "train": ph.get("train", 0.0)}
            row["other"] = step - sum(row.values())
        out.append({**row, "step": step})
    return out


def summarize(name: str, runs: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Print one side's line and return its medians (wall, p10 wall, CPU seconds per step)."""
    steady = _steady(runs, "step_s", warmup)
    out = {
        "wall": _median(steady),
        "p10": statistics.quantiles(steady, n=10)[0] if len(steady) > 1 else float("nan"),
        "cpu": _median(_steady(runs, "cpu_s", warmup)),
    }
    per_run = ", ".join(f"{_median(r['step_s'][warmup:]):.3f}" for r in runs)
    loads = ", ".join(f"{r['load_start']:.1f}->{r['load_end']:.1f}" for r in runs)
    print(
        f"{name:8s} step wall median {out['wall']:.3f} s (per run {per_run}; p10 {out['p10']:.3f} s) over "
        f"{len(steady)} steady steps | CPU {out['cpu']:.3f} s/step | generated tokens/step median "
        f"{_median(_steady(runs, 'gen_tokens', warmup)):.0f} | 1-min load {loads}"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steady steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="leading steps discarded per run")
    p.add_argument("--rounds", type=int, default=2, help="TRL/relayrl alternations")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--relayrl-override", action="append", default=[], metavar="KEY=VALUE", help="extra relayrl override (repeat)"
    )
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES), help="tiny (0.56M) or 25m parameters")
    p.add_argument(
        "--trl-threads", type=int, nargs="+", default=[1, 2], help="TRL runs at each; its fastest is the comparison"
    )
    p.add_argument(
        "--relayrl-trainer", default="async", choices=sorted(TRAINERS), help="relayrl trainer (see TRAINERS)"
    )
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["trl", "relayrl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return

    with tempfile.TemporaryDirectory(prefix="bench_trl_vs_relayrl_") as tmp:
        model_dir = str(Path(tmp) / "tiny-qwen2")
        n_params = build_model_dir(Path(model_dir), args.model_size)
        from relayrl.models.fast.kernels import load_cpu_kernels

        load_cpu_kernels()  # build relayrl's compiled CPU kernels now (cached), not inside a timed run
        flops_per_token, prompt_tokens = matmul_flops_per_token(model_dir)
        peak = gemm_peak_gflops(MODEL_SIZES[args.model_size].get("hidden_size", 128))
        dims = ", ".join(f"{k}={v}" for k, v in MODEL_SIZES[args.model_size].items())
        print(f"model: random Qwen2 ({args.model_size}: {dims}), {n_params:,} params; ", end="")
        print(f"{NUM_PROMPTS}x{NUM_GENERATIONS} per step, ")
        print(
            f"  <= {MAX_NEW_TOKENS} new tokens, beta {KL_BETA}, lr {args.lr}, fp32; TRL threads {args.trl_threads}, ",
            end="",
        )
        print(f"relayrl {args.relayrl_trainer} (1 thread per side); ", end="")
        print(f"{args.rounds} rounds x {args.steps} steady steps (+{args.warmup} warm-up) each")
        sides = [(f"trl{t}", "trl", t) for t in args.trl_threads] + [("relayrl", "relayrl", 1)]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in sides}
        for r in range(args.rounds):
            for name, kind, threads in sides:
                rec = spawn(kind, model_dir, args, Path(tmp) / f"{name}_{r}.json", threads)
                runs[name].append(rec)
                print(f"round {r + 1} {name:8s} median step {_median(rec['step_s'][args.warmup :]):.3f} s", flush=True)
    print()
    trl_by_threads = {t: summarize(f"TRL x{t}", runs[f"trl{t}"], args.warmup) for t in args.trl_threads}
    fastest = min(trl_by_threads, key=lambda t: trl_by_threads[t]["wall"])
    runs["trl"] = runs[f"trl{fastest}"]
    trl = trl_by_threads[fastest]
    rl = summarize(f"relayrl ({args.relayrl_trainer})", runs["relayrl"], args.warmup)
    print(f"TRL's fastest thread count: {fastest} (the comparison below uses it)")
    print("CPU s/step by phase, medians. TRL: logprobs = rollout - sampling (reference pass, reward, advantages),")
    print("  train = rest of step. relayrl: logprobs = prev + reference passes; other = reward, data, advantages, log")
    print(f"  {'':8s} {'generation':>10s} {'logprobs':>10s} {'train':>10s} {'other':>10s} {'step':>10s}")
    cpu_sides = ("trl", "relayrl") if args.relayrl_trainer == "legacy" else ("trl",)  # async: phases overlap
    for name in cpu_sides:
        rows = _cpu_phase_rows(runs[name], args.warmup, trl=name == "trl")
        cols = [_median([ph[k] for ph in rows]) for k in ("generation", "logprobs", "train", "other", "step")]
        print(f"  {name:8s} " + " ".join(f"{c:10.4f}" for c in cols))
    print("relayrl phases (median s, metrics.jsonl timing/train/*):")
    for key in sorted({k for r in runs["relayrl"] for k in r["phases"]}):
        vals = [x for r in runs["relayrl"] for x in r["phases"][key][args.warmup :]]
        print(f"  {key.removeprefix('timing/train/'):32s} {_median(vals):.4f}")
    gen_tokens = _median(_steady(runs["relayrl"], "gen_tokens", args.warmup))
    floor = fp32_floor(flops_per_token, prompt_tokens, gen_tokens, peak)
    print(
        f"fp32 floor of relayrl's step: {floor:.3f} s ({flops_per_token * 1e-6:.1f} MFLOP/token of linear layers, "
        f"{prompt_tokens}-token prompts, {gen_tokens:.0f} generated tokens; both cores at this core's measured "
        f"{peak:.0f} GFLOPS): {floor / rl['wall']:.2f} of relayrl's step, {floor / trl['wall']:.3f} of TRL's"
    )
    ratio = rl["wall"] / trl["wall"]
    print(
        f"\nratio relayrl/TRL: median step wall {ratio:.3f} (target <= 0.5: {'PASS' if ratio <= 0.5 else 'FAIL'}); "
        f"p10 wall {rl['p10'] / trl['p10']:.3f}; median CPU s/step {rl['cpu'] / trl['cpu']:.3f}"
        + ("" if args.relayrl_trainer == "legacy" else " (relayrl's generation process not counted)")
    )


if __name__ == "__main__":
    main()

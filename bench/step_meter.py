"""Shared by the GRPO step benchmarks (`trl_vs_relayrl.py`): per-step wall and CPU clocks, and the matmul floor.

Imported by the scripts beside it (their folder is first on sys.path).
"""

from __future__ import annotations

import statistics
import time
from typing import Any


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


def fp32_floor(
    flops_per_token: float, prompt_tokens: int, gen_tokens: float, peak: float, prompts: int, cores: int = 2
) -> float:
    """Seconds per step below which no fp32 implementation of relayrl's step can go on `cores` cores at `peak`
    GFLOPS each: generation (one forward per generated token), the reference pass (one forward over the step's
    distinct tokens: each prompt once, every completion) and training (forward + backward, three forwards' worth)."""
    distinct = prompts * prompt_tokens + gen_tokens
    return flops_per_token * (gen_tokens + 4 * distinct) / (cores * peak * 1e9)


def median(xs: list[float]) -> float:
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

"""Cost of recording the sampler's kept sets (`policy.generation.support_max_tokens`) in one sampling call.

Why: with top_k / top_p set, every decode step also writes each row's kept set (`sampling.support_record`: a top-k
of width + 1 over the filtered logits, a sort of the ids). This times the sampler's call with and without the
record on a Qwen-sized vocabulary (151,936), interleaved call by call so a shared box disturbs both alike: CPU
seconds of this thread, medians, and their ratio. The decode step's forward pass is not included (the figure is
the sampling op's own).

    python bench/sampler_support.py --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from relayrl.models.generation.sampling import TokenSampler

VOCAB = 151_936


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for rows in args.rows:
        logits = 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))  # [B, V]
        for top_k, top_p, width in ((50, 1.0, 100), (None, 0.95, 64)):
            plain = TokenSampler(top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(0))
            recording = TokenSampler(
                top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(0), record_support=width
            )
            times: dict[str, list[float]] = {"plain": [], "record": []}
            for i in range(args.rounds + 2):
                for name, sampler in (("plain", plain), ("record", recording)):
                    start = time.thread_time()
                    sampler(logits)
                    if i >= 2:  # two warm-up rounds
                        times[name].append(time.thread_time() - start)
            a, b = statistics.median(times["plain"]), statistics.median(times["record"])
            print(
                f"rows={rows} top_k={top_k} top_p={top_p} width={width}: sampler {a * 1e3:.2f} ms, "
                f"with record {b * 1e3:.2f} ms, ratio {b / a:.3f}"
            )


if __name__ == "__main__":
    main()

"""Latency percentiles that merge across clients: a log-bucketed histogram of call durations.

Why a histogram and not the samples or per-client percentiles: every worker (and the rollout actor) meters its own
client and ships its counters to the driver as flat floats; a percentile of the union cannot be computed from
per-client percentiles, and shipping every sample grows with the run. Bucket counts add up exactly, so merging is a
sum, and a bucket spans a factor of 2**(1/8): a percentile read at its bucket's geometric middle is within about
4.5% of the exact order statistic (nearest rank).

Wire form inside a `data_plane/*` metrics dict: `<prefix><op>/ms_hist/<bucket>` = count. `metrics.merge_clients`
sums them across clients and `metrics.strip_sketches` removes them before logging.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

BUCKETS_PER_DOUBLING = 8
FLOOR_MS = 1e-3
"""Durations at or below one microsecond share bucket 0."""
HIST = "ms_hist/"


def bucket_of(ms: float) -> int:
    """The bucket of a duration in milliseconds: 0 up to `FLOOR_MS`, then one per 2**(1/8)."""
    if not ms > FLOOR_MS:  # also NaN
        return 0
    return 1 + int(math.floor(math.log2(ms / FLOOR_MS) * BUCKETS_PER_DOUBLING))


def bucket_ms(bucket: int) -> float:
    """The duration a bucket stands for: the geometric middle of its range."""
    if bucket <= 0:
        return FLOOR_MS
    return FLOOR_MS * 2.0 ** ((bucket - 0.5) / BUCKETS_PER_DOUBLING)


class LatencySketch:
    """Counts per bucket; `add` one duration, `merge` another sketch, read `quantile`."""

    def __init__(self, counts: Mapping[int, int] | None = None) -> None:
        self.counts: dict[int, int] = dict(counts or {})

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, ms: float) -> None:
        b = bucket_of(ms)
        self.counts[b] = self.counts.get(b, 0) + 1

    def merge(self, other: LatencySketch) -> None:
        for b, c in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + c

    def quantile(self, q: float) -> float:
        """Milliseconds at quantile `q` in (0, 1] (nearest rank: the ceil(q n)-th smallest duration)."""
        n = self.total
        if n == 0:
            return 0.0
        rank, seen = max(1, math.ceil(q * n)), 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                return bucket_ms(b)
        return bucket_ms(max(self.counts))

    def to_metrics(self, prefix: str) -> dict[str, float]:
        """`{prefix + "ms_hist/<bucket>": count}`."""
        return {f"{prefix}{HIST}{b}": float(c) for b, c in sorted(self.counts.items())}

    @classmethod
    def from_metrics(cls, items: Iterable[tuple[str, float]]) -> LatencySketch:
        """A sketch from `("...ms_hist/<bucket>", count)` pairs (any prefix)."""
        return cls({int(k.rsplit("/", 1)[1]): int(v) for k, v in items})

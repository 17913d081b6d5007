"""The mergeable latency histogram (latency.py): percentiles within its bucket resolution of the exact order
statistic, merging is exact, and the flat-metrics wire form round-trips."""

from __future__ import annotations

import math
import random

from relayrl.data_plane.latency import BUCKETS_PER_DOUBLING, LatencySketch, bucket_ms, bucket_of

RESOLUTION = 2 ** (1 / (2 * BUCKETS_PER_DOUBLING)) - 1  # a bucket's geometric middle is this close to any member


def _exact(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def test_quantiles_within_bucket_resolution_of_exact() -> None:
    rng = random.Random(0)
    samples = [rng.lognormvariate(0.0, 1.5) for _ in range(2000)]  # ms, a long tail like real calls
    sketch = LatencySketch()
    for ms in samples:
        sketch.add(ms)
    for q in (0.5, 0.9, 0.99):
        assert abs(sketch.quantile(q) / _exact(samples, q) - 1) <= RESOLUTION + 1e-12


def test_merge_is_the_sketch_of_the_union_and_wire_round_trips() -> None:
    rng = random.Random(1)
    a_ms = [rng.expovariate(1.0) for _ in range(300)]
    b_ms = [50 + rng.expovariate(0.1) for _ in range(100)]  # a slow client: averaging percentiles would hide it
    a, b, union = LatencySketch(), LatencySketch(), LatencySketch()
    for ms in a_ms:
        a.add(ms)
        union.add(ms)
    for ms in b_ms:
        b.add(ms)
        union.add(ms)
    merged = LatencySketch.from_metrics(a.to_metrics("data_plane/get/").items())
    merged.merge(LatencySketch.from_metrics(b.to_metrics("data_plane/get/").items()))
    assert merged.counts == union.counts and merged.total == 400
    assert merged.quantile(0.9) > 50 > (a.quantile(0.9) + b.quantile(0.9)) / 2  # not an average of percentiles


def test_buckets() -> None:
    assert bucket_of(0.0) == 0 and bucket_of(float("nan")) == 0 and LatencySketch().quantile(0.5) == 0.0
    for ms in (0.002, 0.37, 1.0, 12.5, 4000.0):
        b = bucket_of(ms)
        assert abs(bucket_ms(b) / ms - 1) <= RESOLUTION + 1e-12

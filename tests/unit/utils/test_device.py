"""relayrl.utils.device: heap reuse for CPU tensor buffers (glibc mallopt)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from relayrl.config import ClusterConfig

# Allocates, uses and frees tensors of 3-13 MiB 30 times (the pattern of a training step's activations) and prints
# the page faults it took. `retain` decides whether the process first calls retain_freed_heap_memory().
_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from relayrl.utils.device import retain_freed_heap_memory
    if sys.argv[1] == "1":
        assert retain_freed_heap_memory()
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    sizes = [(1 << 20) * k // 4 for k in (3, 5, 7, 9, 11, 13)]
    for i in range(30):
        if i == 10:  # the first iterations grow the heap (and adapt glibc's thresholds); count the later ones
            start = faults()
        ts = [torch.ones(s) for s in sizes]
        ys = [t * 2 for t in ts]
        del ts, ys
    print(faults() - start)
    """
)


# glibc's documented default thresholds (128 KiB), fixed: glibc otherwise raises them dynamically after the first
# frees, so whether the unconfigured baseline keeps or unmaps these blocks varies from run to run.
_GLIBC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _faults(retain: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "1" if retain else "0"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **_GLIBC_DEFAULTS},
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc-only"
)
def test_retained_heap_memory_stops_page_faulting_freed_buffers_back_in() -> None:
    default, retained = _faults(False), _faults(True)
    # With glibc's default thresholds the freed multi-MiB blocks are unmapped, so each of the 20 counted iterations
    # faults ~100 MiB of pages in again (~490,000 faults); kept, the counted iterations reuse the blocks.
    assert default > 100_000
    assert retained < default / 20  # observed: 0-7,000


def test_cluster_config_turns_heap_reuse_on_by_default_and_can_turn_it_off() -> None:
    assert ClusterConfig().retain_freed_memory is True
    assert ClusterConfig(retain_freed_memory=False).retain_freed_memory is False

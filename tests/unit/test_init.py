"""The package root: importing relayrl makes CPU matrix products independent of where their operands sit in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# One decode-shaped product (1 row) against 15 copies of the same weight at 15 unaligned offsets; prints how many of
# them gave a result that differs in any bit from the aligned weight's.
_PROBE = """
import json, sys
if sys.argv[1] == "relayrl":
    import relayrl  # noqa: F401
import torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x, w = torch.randn(1, 128, generator=g), torch.randn(512, 128, generator=g)
ref = torch.nn.functional.linear(x, w)
differ = 0
for offset in range(1, 16):
    buf = torch.empty(w.numel() + 16)
    moved = buf[offset : offset + w.numel()].view_as(w).copy_(w)
    differ += int(not torch.equal(torch.nn.functional.linear(x, moved), ref))
print(json.dumps({"differ": differ, "cbwr": __import__("os").environ.get("MKL_CBWR")}))
"""


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch is not built with MKL")
def test_importing_relayrl_makes_products_independent_of_operand_alignment() -> None:
    plain = _probe("plain")
    assert plain["cbwr"] is None
    if plain["differ"] == 0:  # then this probe cannot see the dependence (another CPU's MKL code path)
        pytest.skip("this CPU's MKL gives alignment-independent 1-row products even without strict mode")
    # measured here (AMD EPYC, MKL 2024.2): 12 of the 15 unaligned copies differ without relayrl's setting
    assert _probe("relayrl") == {"differ": 0, "cbwr": "AUTO,STRICT"}


def test_a_users_own_mkl_cbwr_is_kept() -> None:
    code = "import os, relayrl; print(os.environ['MKL_CBWR'])"
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "COMPATIBLE"

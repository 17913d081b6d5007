#!/usr/bin/env bash
# Sets up .venv with what the tests need (dev tools, datasets, Ray, TransferQueue, peft, TRL; idempotent) and runs
# the checks CI runs: lint, format, type check, the CPU test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,ray,transfer_queue,lora,bench
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# Two workers (pytest-xdist): each module's `ray` tests together on one of them (tests/conftest.py); the 25 slowest
# tests are listed at the end.
.venv/bin/python -m pytest -n "${RELAYRL_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"

#!/usr/bin/env bash
# Sets up .venv with what the tests need (dev tools, datasets, Ray, TransferQueue, peft, TRL; idempotent) and runs
# the checks CI runs: lint, format, type check, the CPU test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,ray,transfer_queue,lora,bench
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Sets up .venv (idempotent) and runs the checks CI runs: lint, format, type check, the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"

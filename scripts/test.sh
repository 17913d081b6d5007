#!/usr/bin/env bash
# Sets up .venv with what the tests need (dev tools, datasets, Ray, TransferQueue, peft, TRL, OpenEnv; idempotent)
# and runs the checks CI runs: lint, format, type check, the CPU test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,ray,transfer_queue,lora,bench,openenv
# Bytecode of the repository's own modules is cached (__pycache__, git-ignored) even where the environment sets
# PYTHONDONTWRITEBYTECODE: every CLI run and Ray actor the suite starts would otherwise compile relayrl from source
# again (0.4-0.6 s of CPU per process importing the trainer and the CLI).
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy checks beside the tests; its report is printed after them only when it fails (pytest's summary stays the last
# line of a green run), and either failing fails the run
mypy_log=$(mktemp)
trap 'rm -f "$mypy_log"' EXIT
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# Two workers (pytest-xdist), a test module's tests together on one of them (--dist loadscope: its module-scoped
# fixtures are built once and its Ray cluster serves it alone), modules in file order so that the long integration
# modules start first; the 25 slowest tests are listed at the end. `bash scripts/test.sh -m quick`: the inner-loop
# subset (tests/conftest.py).
pytest_rc=0
.venv/bin/python -m pytest -n "${RELAYRL_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder --durations=25 "$@" \
    || pytest_rc=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
if [ "$mypy_rc" -ne 0 ]; then
    cat "$mypy_log"
    echo "mypy failed (exit $mypy_rc)"
    exit "$mypy_rc"
fi
exit "$pytest_rc"

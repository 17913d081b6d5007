#!/usr/bin/env bash
# Creates .venv and installs relayrl for CPU training: `bash scripts/setup.sh` (the trainer alone), or with extras,
# e.g. `bash scripts/setup.sh ray,wandb` (see [project.optional-dependencies] in pyproject.toml).
# torch is pinned and installed first so that pip never resolves a CUDA build of it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
EXTRAS=${1:-}

pip_quiet() {  # pip, minus this machine's noisy "Location ... is ignored" lines; keeps pip's exit code
    local log rc=0
    log=$(mktemp)
    .venv/bin/python -m pip install -q "$@" >"$log" 2>&1 || rc=$?
    grep -v "^WARNING: Location" "$log" || true
    rm -f "$log"
    return $rc
}

pip_quiet --upgrade pip
pip_quiet "torch==2.13.0"
pip_quiet -e ".${EXTRAS:+[$EXTRAS]}" "torch==2.13.0"
.venv/bin/python -c "import torch, transformers, relayrl; print(f'relayrl {relayrl.__version__} ready (torch {torch.__version__}, transformers {transformers.__version__})')"

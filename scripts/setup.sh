#!/usr/bin/env bash
# Creates .venv and installs relayrl for CPU training: `bash scripts/setup.sh` (the trainer alone), or with extras,
# e.g. `bash scripts/setup.sh ray,wandb` (see [project.optional-dependencies] in pyproject.toml).
# torch is pinned (the CPU wheel where pip's find-links hold one) so that no CUDA build of it is resolved.
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

# uv installs the same requirements 3-4x faster than pip (parallel downloads, one resolve); pip is the fallback
# where uv cannot be installed. uv does not read pip's configuration, so pip's find-links (where a local torch
# wheel may lie) are passed on.
if [ -x .venv/bin/uv ] || pip_quiet uv 2>/dev/null; then
    links=()
    pip_links=$(.venv/bin/python -m pip config list 2>/dev/null | sed -n "s/^global.find-links='\(.*\)'$/\1/p")
    for d in ${PIP_FIND_LINKS:-} $pip_links; do
        links+=(--find-links "$d")
    done
    .venv/bin/uv pip install -q --python .venv/bin/python "${links[@]}" "torch==2.13.0" -e ".${EXTRAS:+[$EXTRAS]}"
else
    pip_quiet --upgrade pip
    pip_quiet "torch==2.13.0"
    pip_quiet -e ".${EXTRAS:+[$EXTRAS]}" "torch==2.13.0"
fi
.venv/bin/python -c "import torch, transformers, relayrl; print(f'relayrl {relayrl.__version__} ready (torch {torch.__version__}, transformers {transformers.__version__})')"

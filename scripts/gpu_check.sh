#!/usr/bin/env bash
# The GPU check for a lent H100/H200 (issue 27), which has no internet: its image holds PyTorch, transformers and
# pytest but not every package relayrl imports, so those travel as wheels made here first:
#
#   bash scripts/gpu_check.sh --fetch-wheels      # here (online): wheels for Python 3.12 into .whl/ (git-ignored)
#   bash scripts/gpu_check.sh                     # there, with .whl carried: tests, then the training run
#
# There it installs the wheels beside the image's packages, prints the versions, runs the `gpu`-marked tests and a
# 20-step bf16 GRPO run of a randomly initialised Qwen2.5-0.5B-shaped model (scripts/gpu_check.py: tokens/s, the
# step-time breakdown, MFU, peak memory). Logs and gpu_check.json go to $OUT (the device tool's folder) or
# /tmp/gpu_check. `GPU_CHECK_STEPS`, `GPU_CHECK_TOKENS` size the run; `--device cpu` dry-runs the plumbing here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# What relayrl imports that the GPU image lacks (pure Python except pydantic-core), pinned to what CI runs with.
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 torchdata==0.11.0
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.9.3)

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    for w in "${WHEELS[@]}"; do
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$w" 2>/dev/null \
            || "$PY" -m pip wheel -q --no-deps -w .whl "$w"  # published as source only (pure Python): built here
    done
    ls -la .whl
    exit 0
fi

device=cuda
if [ "${1:-}" = "--device" ]; then device=$2; shift 2; fi
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
site=/tmp/relayrl-gpu-site
# the wheels carried from here, where the interpreter lacks what they hold (a dry run in this venv needs none)
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c "import pydantic, math_verify, torchdata" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c "import sys, torch, transformers, pydantic, relayrl
print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__,
      '| pydantic', pydantic.__version__, '| cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/versions.txt"

status=0
if [ "$device" = cuda ]; then
    # the gpu-marked tests (pyproject's addopts deselect them everywhere else)
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --durations=10 tests 2>&1 | tee "$out/gpu_tests.log" || status=$?
fi
work=/tmp/gpu_check_work  # the model (2 GB) and the run stay out of $OUT, whose files travel back
"$PY" scripts/gpu_check.py --out "$work" --device "$device" --steps "${GPU_CHECK_STEPS:-20}" \
    --max-new-tokens "${GPU_CHECK_TOKENS:-256}" "$@" 2>&1 | tee "$out/gpu_check.log" || status=$?
cp "$work/gpu_check.json" "$out/" 2>/dev/null || true
exit "$status"

#!/usr/bin/env bash
# run.sh [--whl] command...: run a command (from the repository root) in the mirrored lent-GPU stack: the venv
# $LENT_STACK_VENV (default /tmp/gpustack16: Python 3.12, torch 2.11.0+cu130, Triton 3.6.0, transformers 5.17.0,
# numpy 2.5.2; how to build it: benchmarks/results/gpu_stack/README.md) first on PATH, the repository first on
# PYTHONPATH, the packages the lent machine lacks blocked (sitecustomize.py); --whl: those of .whl/ allowed from
# $LENT_STACK_SITE (default /tmp/lent-stack-site, made here from .whl/ when absent), as after gpu_wheels.sh.
#   benchmarks/gpu/lent_stack/run.sh --whl python -m pytest -q -x tests/test_gpu_loan.py
#   TINY=1 OUT=/tmp/tiny benchmarks/gpu/lent_stack/run.sh --whl bash benchmarks/gpu_loan.sh call1
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
venv="${LENT_STACK_VENV:-/tmp/gpustack16}"
[ -x "$venv/bin/python" ] || { echo "run.sh: no venv at $venv (LENT_STACK_VENV)" >&2; exit 2; }
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" PYTHONPATH="$repo:$here"
export LENT_STACK_ALLOW=
if [ "${1:-}" = --whl ]; then
  shift
  site="${LENT_STACK_SITE:-/tmp/lent-stack-site}"
  if [ ! -d "$site" ]; then
    ls "$repo"/.whl/*.whl >/dev/null 2>&1 || { echo "run.sh --whl: no .whl/ (bash benchmarks/gpu_wheels.sh)" >&2; exit 2; }
    "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$repo"/.whl/*.whl
  fi
  export LENT_STACK_ALLOW="$site"
fi
exec "$@"

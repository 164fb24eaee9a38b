#!/usr/bin/env bash
# The prepared GPU check for a lent CUDA machine, as it is: no venv, no install (it has no package registry).
# Run from anywhere:  bash benchmarks/gpu_check.sh [--only PART[,PART]] [--budget-s S]   (log and JSON under $OUT)
# Without CUDA it says so in one line and exits non-zero. Parts and their checks: benchmarks/gpu_check.py.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"

#!/usr/bin/env bash
# Set up (or reuse) .venv in the repo root, install jattn with everything the
# tests need, lint, and run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[train,test]"
.venv/bin/ruff check jattn tests experiments benchmarks configs
.venv/bin/ruff format --check jattn tests experiments benchmarks configs
export JAX_PLATFORMS=cpu
# pytest exits 5 when it collects no test: that is a failure here too.
.venv/bin/python -m pytest -n 2 --dist loadfile -q "$@"

#!/usr/bin/env bash
# The main job on a fresh machine: set up (or reuse) .venv in the repo root,
# install jattn, and run the positional ablation on the local `numbers` task
# on the CPU (8 schemes x 2 seeds). Results land in runs/positional/:
# results.csv, results.md, loss_curves.png, accuracy_by_length.png.
# Extra arguments go to `jattn ablate` (e.g. --config.grid.seed.values=0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[train]"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/jattn ablate --config experiments/positional.py \
  --workdir "${WORKDIR:-runs/positional}" "$@"

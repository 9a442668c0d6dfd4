#!/usr/bin/env bash
# The main job on a fresh machine: set up (or reuse) .venv in the repo root,
# install jattn, and run the length-generalisation grid on the CPU: every
# positional scheme x 3 seeds on reversing digit strings (1-16 digits in
# training, 17-24 in test_longer; experiments/positional.py). Results land in
# runs/positional/: results.csv, results.md (intervals, what is within noise),
# loss_curves.png, accuracy_by_length.png, exact_match.png.
# Extra arguments go to `jattn ablate` (e.g. --config.grid.seed.values=0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[train]"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# lab/grid.py: `jattn ablate` with the lab's record of the session's wall time
# and load, which the report's "Cost" section carries.
exec .venv/bin/python lab/grid.py --config experiments/positional.py \
  --workdir "${WORKDIR:-runs/positional}" "$@"

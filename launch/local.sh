#!/usr/bin/env bash
# Fresh machine to results: create .venv, install jattn with its training extras, run jattn.
#
#   launch/local.sh                                   # trains configs/numbers.py into runs/numbers
#   launch/local.sh train --config configs/smoke.py --workdir runs/smoke
#   launch/local.sh configs --paths configs/numbers.py
#   JAX_EXTRA=cuda12 launch/local.sh train --config configs/base.py --workdir runs/base
#
# Re-running is cheap: the venv is reused, and `jattn train` resumes its workdir.
# Environment: PYTHON (default python3, >= 3.11), VENV (default .venv),
# JAX_EXTRA (cuda12 / tpu: installs jax[...] for that accelerator; default: CPU jax).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import jattn.train" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet -e ".[train,test]"
fi
if [ -n "${JAX_EXTRA:-}" ]; then
  "$VENV/bin/pip" install --quiet "jax[${JAX_EXTRA}]"
else
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
fi

if [ $# -eq 0 ]; then
  set -- train --config configs/numbers.py --workdir runs/numbers
fi
exec "$VENV/bin/jattn" "$@"

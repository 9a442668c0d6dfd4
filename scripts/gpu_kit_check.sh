#!/usr/bin/env bash
# Prove the kit (scripts/gpu_kit.sh) complete: a clean Python 3.12 venv that
# holds only what the GPU image has and jattn needs (jax==0.11.2 on the CPU,
# flax, optax, orbax-checkpoint, chex, numpy and the image's other packages
# jattn imports, with pip's own resolution of their needs) takes the kit's
# wheels with --no-index --no-deps into /tmp/site, as the window does, and
# runs the window's training stage (a smoke `jattn train` of the Delétang tape
# config, both arms) from the prepared data, then the grid window's dry run
# (`gpu_window.sh --grid --cpu`: `jattn ablate` with --jobs, its report, the pack).
# Whatever fails to import there names a wheel the kit lacks.
#
#   bash scripts/gpu_kit_check.sh        # VENV=/tmp/gpuvenv SITE=/tmp/gpukit_site
# Needs network for the venv's first build (PyPI); the kit itself is offline.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
VENV=${VENV:-/tmp/gpuvenv}
SITE=${SITE:-/tmp/gpukit_site}
PY312=${PY312:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12}
[ -d .gpukit/wheels ] || { echo "gpu_kit_check: no .gpukit/wheels (run scripts/gpu_kit.sh)" >&2; exit 1; }
# The GPU image's packages that jattn imports (KINDS.md's list), nothing else.
IMAGE=(jax==0.11.2 flax optax orbax-checkpoint chex numpy absl-py etils protobuf pyarrow psutil
       tqdm wrapt pyyaml requests rich tensorstore msgpack cloudpickle matplotlib sentencepiece
       sacrebleu tensorboard typing-extensions zipp fsspec six attrs packaging scipy)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY312" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "${IMAGE[@]}"
rm -rf "$SITE"
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .gpukit/wheels/*.whl
"$VENV/bin/python" -m pip check 2>&1 | sed 's/^/pip check (venv alone): /' || true
echo "gpu_kit_check: venv $("$VENV/bin/python" -c 'import sys,jax,flax;print(sys.version.split()[0],"jax",jax.__version__,"flax",flax.__version__)')"
out=$(mktemp -d)
PYTHONPATH="$SITE:$root" JAX_PLATFORMS=cpu "$VENV/bin/python" benchmarks/gpu.py --train \
  --cpu-smoke --total-s 400 --data-dir .gpukit/data --out "$out/train.csv"
cat "$out/train.csv"
# The grid window as the GPU machine runs it (the kit into the window's /tmp/site), on
# the CPU: its tiny data is prepared on first use into a scratch folder, not the kit.
PYTHON="$VENV/bin/python" GPU_WINDOW_DATA="$out/data" GPU_GRID_STATE="$out/grid" \
  bash scripts/gpu_window.sh "$out/grid_window" --grid --cpu
ls "$out/grid_window"
echo "gpu_kit_check: ok (the kit installs with --no-index, trains and runs the grid in a clean 3.12 venv)"

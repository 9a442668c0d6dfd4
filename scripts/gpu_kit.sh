#!/usr/bin/env bash
# Prepare what a bare GPU machine lacks for the window (scripts/gpu_window.sh),
# into the ignored folder .gpukit/ that travels with the command (carry
# [".gpukit"], <= 64 MiB with the tree):
#   .gpukit/wheels/  the wheels its image does not have (docs/gpu.md, "The
#                    prepared window"): pure-python or cp312 manylinux x86_64,
#                    the versions of the project's venv where it has them;
#   .gpukit/data/    the tfds data the window's training reads, prepared here
#                    by jattn's own builders (nothing there reaches a registry).
# jattn itself travels as the tree and is imported through PYTHONPATH.
#
#   bash scripts/gpu_kit.sh             # then: bash scripts/gpu_kit_check.sh
# Env: PYTHON (the venv that prepares the data; default /work/main/.venv/bin/python
# or python3), PIP (the pip that downloads; default "$PYTHON -m pip").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PYTHON=${PYTHON:-$( [ -x /work/main/.venv/bin/python ] && echo /work/main/.venv/bin/python || echo python3 )}
PIP=${PIP:-"$PYTHON -m pip"}
kit=.gpukit
mkdir -p "$kit/wheels" "$kit/data"

# What the GPU image lacks that `jattn train` imports, with their own needs
# (the image's list: /work/.library/device/KINDS.md). One version each: two
# of one name stop the whole --no-index install there.
WHEELS=(
  tensorflow-datasets==4.9.10
  array-record==0.8.6
  dm-tree==0.1.10
  immutabledict==4.3.1
  promise==2.3
  simple-parsing==0.1.9
  docstring-parser==0.18.0
  tensorflow-metadata==1.21.0
  googleapis-common-protos==1.76.0
  termcolor==3.3.0
  toml==0.10.2
  importlib-resources==7.1.0
  grain==0.2.18
  portpicker==1.6.0
  ml-collections==1.1.0
  num2words==0.5.14
  docopt==0.6.2
  tensorboardx==2.6.5
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 any; do
  platforms+=(--platform "$p")
done
for w in "${WHEELS[@]}"; do
  name=${w%%==*}
  # Already there (any version of this name): keep it, so that a rerun is cheap.
  norm=$(echo "$name" | tr '-' '_')
  if ls "$kit/wheels/" 2>/dev/null | grep -qi "^${norm}-"; then continue; fi
  # promise and docopt publish only sdists: build their wheel here (pure python).
  if ! $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$kit/wheels" "$w" 2>/dev/null; then
    $PIP wheel -q --no-deps --no-build-isolation -w "$kit/wheels" "$w" \
      || { echo "gpu_kit: no wheel for $w" >&2; exit 1; }
  fi
done

# protobuf, only where the image's is older than tensorflow_metadata's generated
# code (6.31.1): the window installs it then alone (the image has its own).
mkdir -p "$kit/fallback"
ls "$kit/fallback" | grep -qi '^protobuf-' || $PIP download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d "$kit/fallback" protobuf==7.36.2

# The data of the window's training (benchmarks/gpu.py: its DATASETS).
datasets=$(PYTHONPATH=$root "$PYTHON" -c 'import runpy; print(" ".join(runpy.run_path("benchmarks/gpu.py")["DATASETS"]))')
for d in $datasets; do
  PYTHONPATH=$root JAX_PLATFORMS=cpu "$PYTHON" -c "
import sys, jattn.data
jattn.data.load(sys.argv[1], data_dir=sys.argv[2])" "$d" "$kit/data" >/dev/null 2>&1 \
    || { echo "gpu_kit: could not prepare $d" >&2; exit 1; }
done
rm -rf "$kit/data/downloads"

echo "gpu_kit: wheels"
du -k "$kit"/wheels/*.whl | sort -n | awk '{printf "  %7.2f MiB  %s\n", $1/1024, $2}'
du -k "$kit"/fallback/*.whl | awk '{printf "  %7.2f MiB  %s (installed only over an older protobuf)\n", $1/1024, $2}'
echo "gpu_kit: data ($datasets)"
du -sk "$kit/data" | awk '{printf "  %7.2f MiB  %s\n", $1/1024, $2}'
total=$(du -sk "$kit" | cut -f1)
awk -v k="$total" 'BEGIN{printf "gpu_kit: total %.2f MiB in .gpukit (limit with the tree: 64 MiB)\n", k/1024}'
[ "$total" -le $((40 * 1024)) ] || { echo "gpu_kit: over 40 MiB" >&2; exit 1; }

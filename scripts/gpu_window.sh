#!/usr/bin/env bash
# The prepared GPU window: ONE command for a bare GPU machine (docs/gpu.md, "The
# prepared window"), every stage under its own timeout, everything in OUTDIR:
#   window.log   probe (nvidia-smi, versions, jax.devices(); each config's attention
#                path: `jattn configs --paths`) and every stage's output
#   check.csv    benchmarks/gpu.py --stage check (the float64 gate)
#   (window.log) the float32-extremes contracts of tests/ on this device (pytest)
#   train.csv    benchmarks/gpu.py --train (Delétang tape model, default rule and xla)
#   train_vs_cpu.csv  lab/gpu_train.py: each arm's final loss against the CPU's seeds
#   timing.csv   benchmarks/gpu.py headline + the backward tile sweep
#   dumps.tgz    the XLA dumps and logs of failed cells (only if there are any)
# Stage budgets (GPU): probe 20 s, paths 60, check 200, contract 90, train 130,
# verdict 30, timing 150 (WINDOW_CHECK_S, WINDOW_TRAIN_S, WINDOW_TIMING_S change
# three), each cut to what is left of the whole window's WINDOW_TOTAL_S (GPU 540 s,
# the dry run 900) with 10 s for a killed stage to exit: the window ends within
# WINDOW_TOTAL_S and the dumps' tar. The stages before timing can use all of the
# 540 s; WINDOW_STAGES (a space-separated subset of paths, check, contract, train,
# verdict, timing; the kit and the probe always run) runs only those, e.g. the timing
# stage in a second call on the same warm machine with the device time left
# (WINDOW_STAGES=timing WINDOW_TOTAL_S=<that time>).
#
# --grid: the second window's work instead (issue 50, item 5): the Delétang/Ruoss
# reverse_string slice (experiments/deletang.py:reverse, 36 runs of 10,000 steps)
# trained by lab/grid.py with --jobs GPU_GRID_JOBS (6) on the one GPU, seed by seed
# (phases GPU_GRID_SEEDS, "0 0,1 0,1,2": a window that ends early leaves whole seeds
# of every scheme), in GPU_GRID_STATE (.gpugrid/), GPU_GRID_ARGS (more of `jattn
# ablate`'s flags) appended. 80 s before the deadline the runs get SIGTERM (each
# saves, the report is written), and the state is packed for the next window
# (lab/gpu_grid.py pack): window.log, results.md, results.csv, grid_state.tgz.00
# (.01, ...). Back here: `python lab/gpu_grid.py unpack FILES_AT .gpugrid`; the same
# command with carry [".gpukit", ".gpugrid"] resumes the grid; `python lab/grid.py
# --config experiments/deletang.py:reverse --workdir .gpugrid/deletang_reverse
# --report-only` renders its report with each window's cost. The dry run (--cpu)
# trains the tiny preset (experiments/deletang.py:tiny: 4 runs of 4 steps, --jobs 2).
#
#   bash scripts/gpu_window.sh OUTDIR          # on the GPU machine (carry [".gpukit"])
#   bash scripts/gpu_window.sh OUTDIR --grid   # (carry [".gpukit", ".gpugrid"])
#   bash scripts/gpu_window.sh OUTDIR --cpu    # the dry run: same stages, tiny shapes
# (GPU_WINDOW_CPU=1 is the same as --cpu.) Build the kit first: scripts/gpu_kit.sh.
# Env: PYTHON (default python3), GPU_WINDOW_DATA (the prepared tfds data; default
# .gpukit/data), GPU_WINDOW_NO_KIT=1 (use the installed packages, not .gpukit/wheels).
# Exit status 1 when a stage failed or timed out (its files are still written); the
# grid stopped at the deadline is no failure (its state goes back).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${1:?usage: gpu_window.sh OUTDIR [--cpu] [--grid]}
cpu=${GPU_WINDOW_CPU:-0} grid=0
# The stages WINDOW_STAGES may pick from (the rest, probe, the grid's and pack, always run).
selectable="paths check contract train verdict timing"
stages=${WINDOW_STAGES:-$selectable}
# among LIST NAME: whether the space-separated LIST holds NAME.
among() { [[ " $1 " == *" $2 "* ]]; }
for s in $stages; do
  among "$selectable" "$s" || {
    echo "gpu_window.sh: WINDOW_STAGES: unknown stage $s ($selectable)" >&2
    exit 2
  }
done
for a in "${@:2}"; do
  case $a in
    --cpu) cpu=1 ;;
    --grid) grid=1 ;;
    *) echo "gpu_window.sh: unknown argument $a (--cpu, --grid)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/window.log
dumps=$(mktemp -d /tmp/jattn_window_dumps.XXXX)
PY=${PYTHON:-python3}
start=$(date +%s)

say() { echo "[window +$(($(date +%s) - start))s] $*" | tee -a "$log"; }
# leftovers TAG: kill what a stage started and left running (a benchmark cell runs in
# a session of its own, so a stage killed at its timeout orphans it, and on a GPU it
# would hold the memory the next stage needs): the processes whose environment
# carries the stage's tag, and no others.
leftovers() {
  local e pid
  for e in /proc/[0-9]*/environ; do
    pid=${e#/proc/}
    pid=${pid%/environ}
    if { tr '\0' '\n' <"$e"; } 2>/dev/null | grep -qx "JATTN_WINDOW_TAG=$1"; then
      kill -9 "$pid" 2>/dev/null && say "killed pid $pid, left running by the stage"
    fi
  done
  return 0
}
# stage NAME SECONDS CMD...: CMD under `timeout`, its output appended to the log.
# The stage's timeout is cut to the window's time left (less 10 s for the kill);
# a stage with under 5 s left is not started, and counts as failed. A selectable
# stage that WINDOW_STAGES leaves out is skipped, silently.
stage() {
  local name=$1 secs
  if among "$selectable" "$name" && ! among "$stages" "$name"; then
    return 0
  fi
  secs=$(left "$2")
  shift 2
  local cmd="$*"
  if [ "$secs" -lt 5 ]; then
    say "stage $name: not started (window deadline, ${WINDOW_TOTAL_S:-$total_s} s)"
    failed+=("$name")
    return 0
  fi
  say "stage $name (timeout ${secs} s): ${cmd:0:300}"
  local tag="$name-$$-$(date +%s%N)"
  JATTN_WINDOW_TAG=$tag timeout -k "$kill_s" "$secs" "$@" >>"$log" 2>&1
  local rc=$?
  leftovers "$tag"
  say "stage $name: rc=$rc$([ $rc -eq 124 ] && echo ' (timed out)')"
  last_rc=$rc
  [ $rc -eq 0 ] || failed+=("$name")
}
failed=() kill_s=10 last_rc=0
# left SECS: SECS, or less: what the window has left before its deadline, less 10 s.
left() {
  local rest=$((deadline - $(date +%s) - 10))
  echo $(($1 < rest ? $1 : rest))
}
# budget SECS: a benchmarks/gpu.py stage's own budget (--total-s): SECS cut so that
# it and the stage's 10 s of slack fit what is left; -10 (not started) under 5 s.
budget() {
  local b=$(($(left $(($1 + 10))) - 10))
  echo $((b < 5 ? -10 : b))
}

if [ "$cpu" = 1 ]; then
  export JAX_PLATFORMS=cpu
  smoke=(--cpu-smoke)
  check_s=150 train_s=240 timing_s=180  # the dry run's (CI's)
  # The dry run's own slice of each stage: the code paths, not every cell (interpret
  # mode on a shared 2-core CPU; tests/test_pallas.py runs the check stage whole).
  check_only=('check/f32_packed_shaw' 'check/mgpu*')
  timing_only=('headline/peak' 'headline/pallas' 'headline/pallas_alibi' 'sweep/bwd*' 'sweep/atomic*'
               'sweep/mgpu_causal')
else
  smoke=()
  check_s=200 train_s=130 timing_s=150
  check_only=('check/*')
  # cuDNN and the plain kernels at the headline shape (the ratio on this card),
  # then the backward's own tiles, then each backward kernel's (dq, dk/dv) alone,
  # each dk/dv tiling beside the atomic backward on it (dq added, no dq kernel):
  # what issue 50's backward work needs first. The check stage runs its cells in
  # gpu.py's order (the training configs' first) and skips what its 200 s leave.
  # The Mosaic GPU cells (`sweep/mgpu*`) time it beside cuDNN and the Triton kernels,
  # causal and not.
  timing_only=('headline/cudnn' 'headline/pallas' 'sweep/bwd*' 'sweep/mgpu*' 'sweep/dq*'
               'sweep/dkv*' 'sweep/atomic*')
  # What this first window leaves to a second: WINDOW_TIMING_ONLY (globs, space-separated)
  # replaces the list, e.g. 'headline/cudnn headline/pallas headline/pallas_shaw
  # headline/pallas_alibi headline/pallas_t5 sweep/dq* sweep/dkv*' for the features'
  # <= 1.3x goals and the per-kernel sweeps (docs/gpu.md, "The prepared window").
fi
if [ -n "${WINDOW_TIMING_ONLY:-}" ]; then
  read -ra timing_only <<< "$WINDOW_TIMING_ONLY"
fi
check_s=${WINDOW_CHECK_S:-$check_s} train_s=${WINDOW_TRAIN_S:-$train_s}
timing_s=${WINDOW_TIMING_S:-$timing_s}
total_s=$([ "$cpu" = 1 ] && echo 900 || echo 540)
deadline=$((start + ${WINDOW_TOTAL_S:-$total_s}))

say "jattn GPU window: $root -> $out (cpu dry run: $cpu)"
[ "$grid" = 1 ] || say "timing cells: ${timing_only[*]}"
if [ -d .gpukit/wheels ] && [ "${GPU_WINDOW_NO_KIT:-0}" != 1 ]; then
  site=/tmp/site
  stage kit 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" .gpukit/wheels/*.whl
  # tensorflow_metadata's generated code needs protobuf >= 6.31.1 at run time.
  if ls .gpukit/fallback/protobuf-*.whl >/dev/null 2>&1 && ! "$PY" -c '
import sys, google.protobuf as p
sys.exit(tuple(int(x) for x in p.__version__.split(".")[:3]) < (6, 31, 1))' 2>/dev/null; then
    stage protobuf 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" .gpukit/fallback/protobuf-*.whl
  fi
  export PYTHONPATH=$site:$root${PYTHONPATH:+:$PYTHONPATH}
else
  say "no .gpukit/wheels: using the installed packages (scripts/gpu_kit.sh builds the kit)"
  export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
fi
data_dir=${GPU_WINDOW_DATA:-$root/.gpukit/data}

probe_py='
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
for m in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "chex", "numpy", "google.protobuf",
          "tensorflow_datasets", "grain", "ml_collections", "array_record"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "IMPORT FAILED:", type(e).__name__, e)
import jax
print("devices", jax.devices())
print("default backend", jax.default_backend())
'
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >>"$log" 2>&1 \
  || say "nvidia-smi: not there or failed"
stage probe 20 "$PY" -c "$probe_py"
# The second window: the reverse_string grid, resumed from GPU_GRID_STATE (see the top).
grid_window() {
  local state=${GPU_GRID_STATE:-$root/.gpugrid} config jobs phases seeds secs
  if [ "$cpu" = 1 ]; then
    config=experiments/deletang.py:tiny jobs=2 phases=(0)
  else
    config=experiments/deletang.py:reverse jobs=${GPU_GRID_JOBS:-6} phases=(0 0,1 0,1,2)
  fi
  [ -n "${GPU_GRID_SEEDS:-}" ] && read -ra phases <<< "$GPU_GRID_SEEDS"
  local extra=()
  [ -n "${GPU_GRID_ARGS:-}" ] && read -ra extra <<< "$GPU_GRID_ARGS"
  local args=(--config "$config" --workdir "$state/deletang_reverse" --jobs "$jobs"
              --config.train.data_dir="$data_dir" "${extra[@]}")
  say "grid: $config in $state, --jobs $jobs, seeds by phase: ${phases[*]}"
  kill_s=40  # after the SIGTERM: every run saves its checkpoint, the report is drawn
  for seeds in "${phases[@]}"; do
    secs=$(($(left 100000) - 70))  # stops 80 s before the deadline: the save, the pack
    if [ "$secs" -lt 60 ]; then
      say "grid: seeds $seeds not started (${secs} s left before the pack)"
      break
    fi
    stage "grid-seeds-$seeds" "$secs" "$PY" lab/grid.py "${args[@]}" --config.grid.seed.values="$seeds"
    if [ "$last_rc" -eq 124 ] || [ "$last_rc" -eq 137 ]; then
      # The deadline, not a failure: the runs saved (137: lab/grid.py outlived the SIGTERM
      # by kill_s and was killed, a save may be cut short: the pack sends each run's latest
      # complete step), and the state goes back.
      unset 'failed[-1]'
      say "grid: stopped at the window's deadline (rc=$last_rc); unpack the state and run the window again"
      break
    fi
    [ "$last_rc" -eq 0 ] || break
  done
  kill_s=10
  cp "$state/deletang_reverse/results.md" "$state/deletang_reverse/results.csv" "$out/" 2>/dev/null
  stage pack 30 "$PY" lab/gpu_grid.py pack "$state" "$out"
}

if [ "$grid" = 1 ]; then
  grid_window
else
  # What `jattn train` would run here: the rule's path for each config's attention.
  mapfile -t configs < <(ls configs/[!_]*.py | grep -v chomsky.py)
  stage paths 60 "$PY" -m jattn.cli configs --paths "${configs[@]}" configs/chomsky.py:reverse_string,test100

  check_s=$(budget "$check_s")
  stage check $((check_s + 10)) "$PY" benchmarks/gpu.py --stage check "${smoke[@]}" \
    --only "${check_only[@]}" --total-s "$check_s" --continue-on-fail --out "$out/check.csv" --dump-dir "$dumps"

  # The suite's float32-extremes contracts run on this device (±3.40e38 behind masks and in
  # visible keys: xla, chunked and the Pallas kernels, all three backwards; logits of 1e5 and
  # 1e9), the float64 oracle on the host: the dq tiles' float32 split is Triton's own on a
  # GPU, which interpret mode only emulates (docs/gpu.md, "float32's largest values on a
  # GPU"), and a GPU's matmuls round the backward's recomputed logits their own way.
  contract_k='(float32_max or extreme_logits) and not Tpu'
  [ "$cpu" = 1 ] && contract_k='float32_max_behind_masks and TestPallas and not Tpu and segment'
  JAX_PLATFORMS=$([ "$cpu" = 1 ] && echo cpu || echo cuda,cpu) stage contract 90 "$PY" -m pytest -v --tb=short \
    -p no:cacheprovider tests/test_attention_contract.py -k "$contract_k"

  train_s=$(budget "$train_s")
  train_args=(--out "$out/train.csv" --total-s "$train_s" --data-dir "$data_dir")
  [ "$cpu" = 1 ] && train_args+=(--cpu-smoke)
  stage train $((train_s + 10)) "$PY" benchmarks/gpu.py --train "${train_args[@]}"
  # Each arm's final loss held to the CPU seeds' (lab/gpu_train.py): train_vs_cpu.csv.
  stage verdict 30 "$PY" lab/gpu_train.py "$out/train.csv"

  timing_s=$(budget "$timing_s")
  stage timing $((timing_s + 10)) "$PY" benchmarks/gpu.py --stage headline sweep "${smoke[@]}" \
    --only "${timing_only[@]}" --total-s "$timing_s" --continue-on-fail \
    --out "$out/timing.csv" --dump-dir "$dumps"

fi

if [ -n "$(ls -A "$dumps" 2>/dev/null)" ]; then
  tar -czf "$out/dumps.tgz" -C "$dumps" .
  # A file over 16 MiB does not come back from the GPU machine: then the logs alone.
  if [ "$(du -k "$out/dumps.tgz" | cut -f1)" -gt $((15 * 1024)) ]; then
    # (find's -size rounds up to its unit: -1M would match only empty files.)
    (cd "$dumps" && find . -type f -size -1024k -print0 | tar -czf "$out/dumps.tgz" --null -T -)
  fi
  say "failed cells' dumps: dumps.tgz ($(du -h "$out/dumps.tgz" | cut -f1))"
fi
rm -rf "$dumps"
say "done in $(($(date +%s) - start)) s; files: $(cd "$out" && ls | tr '\n' ' ')"
[ ${#failed[@]} -eq 0 ] || { say "stages that failed or timed out: ${failed[*]}"; exit 1; }

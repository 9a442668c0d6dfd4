#!/usr/bin/env bash
# Set up (or reuse) .venv in the repo root, install jattn with everything the
# tests need, lint, and run the whole test suite on the CPU (Python 3.11 or
# $PYTHON, jax 0.10.2). Then the second jax: .venv-jax12 (Python 3.12, which
# jax >= 0.11 needs; made here from pyenv's 3.12 or $PYTHON312) with the
# newest jax 0.12.x, running SECOND_JAX_TESTS below (or, when arguments are
# given, the same arguments as the first run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[train,test]"
.venv/bin/ruff check jattn tests experiments benchmarks configs lab
.venv/bin/ruff format --check jattn tests experiments benchmarks configs lab
# The Mosaic (TPU) kernels compiled by libtpu for a compile-only TPU v5e (no
# TPU needed): CI's subset of `python benchmarks/aot.py --target tpu` (plain, Shaw and
# ALiBi; bfloat16, head dim 128; forward + vjp), in .venv-tpu (libtpu pins
# jax), so a kernel change that Mosaic cannot compile fails here. About 2
# minutes with the install (docs/tpu.md).
[ -x .venv-tpu/bin/python ] || "$PY" -m venv .venv-tpu
.venv-tpu/bin/python -m pip install -q -e ".[aot-tpu]"
timeout -k 30 600 .venv-tpu/bin/python benchmarks/aot.py --target tpu --ci \
    --out "$(mktemp -d)/aot_tpu.md"
export JAX_PLATFORMS=cpu
# glibc's own fatal messages (heap corruption, ...) to stderr, not the tty, so
# a crashed xdist worker says why in the log.
export LIBC_FATAL_STDERR_=1
# pytest-xdist's controller can hang after a worker crashes (seen twice: the
# crashed worker's test is reported, then the session never ends), so each
# pytest run has a wall-clock limit and fails with a message past it instead
# of running into CI's own limit of 90 minutes. The limits come from one
# budget for the whole script, JATTN_TEST_BUDGET seconds from its start
# (default 88 minutes): the main suite may use all of it but the last 15
# minutes, kept for the second jax's install and run (10-14 minutes on a
# 2-core AMD EPYC, where the main suite took 55-60), and the second jax what
# is left. JATTN_TEST_TIMEOUT (seconds) instead gives each run a fixed limit.
budget=${JATTN_TEST_BUDGET:-5280}
run_pytest() {
    local reserve=$1 limit rc=0
    shift
    limit=${JATTN_TEST_TIMEOUT:-$((budget - SECONDS - reserve))}
    if [ "$limit" -lt 60 ]; then
        echo "scripts/test.sh: ${SECONDS} s of the ${budget} s budget gone; not starting: $*" >&2
        return 1
    fi
    timeout -k 60 "$limit" "$@" || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "scripts/test.sh: pytest ran past ${limit} s and was stopped: $*" >&2
    fi
    return "$rc"
}
# pytest exits 5 when it collects no test: that is a failure here too.
run_pytest 900 .venv/bin/python -m pytest -n 2 --dist loadfile -q "$@"

# The second jax. The subset is what jattn promises on every jax it supports:
# the core (attention implementations, masks, positions, dropout, memory
# counts, import and errors), the kernels (Triton-style in interpret mode,
# the Mosaic TPU ones, lowering for CUDA and TPU), the
# models and decoding, and the drop-in contracts (jax.nn, flax's
# attention_fn). Left out: the training loop, data pipelines, CLI,
# experiments and fault tests, which depend on flax/orbax/grain more than on
# jax's version, and would take CI past 30 minutes on a 2-core machine.
# Every test function of the subset runs, each parametrized one on one case,
# alternately its first and its last (--param-sample, tests/conftest.py): the
# first jax runs every case. Timings: docs/gpu.md, "Two jax versions in CI".
SECOND_JAX_TESTS=(
    tests/test_attention.py tests/test_attention_contract.py tests/test_masks.py
    tests/test_positions.py
    tests/test_errors_and_import.py tests/test_chunked_window_dropout.py
    tests/test_dropout.py tests/test_memory.py
    tests/test_pallas.py tests/test_kernel_variants.py tests/test_pallas_tpu.py
    tests/test_kernel_precision.py tests/test_pallas_score_mod.py tests/test_row_col.py
    tests/test_models.py tests/test_decoding.py
    tests/test_dropin_jax_nn.py tests/test_flax_adapter.py
    tests/test_mosaic_gpu.py
)
if [ -z "${PYTHON312:-}" ]; then
    if command -v pyenv >/dev/null && [ -d "$(pyenv root)/versions" ]; then
        PYTHON312=$(ls -d "$(pyenv root)"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -1)
    fi
    PYTHON312=${PYTHON312:-python3.12}
fi
[ -x .venv-jax12/bin/python ] || "$PYTHON312" -m venv .venv-jax12
.venv-jax12/bin/python -m pip install -q --upgrade pip
.venv-jax12/bin/python -m pip install -q -e ".[train,test]" "jax==0.12.*"
.venv-jax12/bin/python -c 'import jax; print("second jax:", jax.__version__)'
if [ "$#" -gt 0 ]; then
    run_pytest 0 .venv-jax12/bin/python -m pytest -n 2 --dist loadfile -q "$@"
else
    run_pytest 0 .venv-jax12/bin/python -m pytest -n 2 --dist loadfile -q --param-sample "${SECOND_JAX_TESTS[@]}"
fi

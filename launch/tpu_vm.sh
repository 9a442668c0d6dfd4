#!/usr/bin/env bash
# Train on a Cloud TPU VM slice: copy this checkout to every worker, install, and run
# `jattn train` on all of them at once. JAX on a TPU slice finds its peers itself (from
# the metadata server; JATTN_DISTRIBUTED=1 tells jattn to call jax.distributed.initialize()),
# so no coordinator flags are needed.
#
#   TPU_NAME=my-v5e-32 ZONE=us-west4-a WORKDIR=/mnt/gcs/runs/base launch/tpu_vm.sh
#   TPU_NAME=... ZONE=... CONFIG=configs/base.py:rope launch/tpu_vm.sh --config.batch_size=512
#
# WORKDIR must be shared by all workers (a gcsfuse-mounted bucket or a Filestore share
# mounted at the same path on each worker). Extra arguments go to `jattn train`.
# Set SETUP=0 to skip copying and installing (code unchanged since the last run).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to its zone}"
PROJECT=${PROJECT:-$(gcloud config get-value project 2>/dev/null)}
CONFIG=${CONFIG:-configs/base.py}
WORKDIR=${WORKDIR:?set WORKDIR to a directory every worker sees}
REMOTE_DIR=${REMOTE_DIR:-jattn}
SETUP=${SETUP:-1}
GCLOUD=(gcloud compute tpus tpu-vm --project "$PROJECT" --zone "$ZONE")

if [ "$SETUP" = 1 ]; then
  archive=$(mktemp /tmp/jattn-XXXXXX.tar.gz)
  git ls-files -z --cached --others --exclude-standard | tar --null -T - -czf "$archive"
  "${GCLOUD[@]}" scp "$archive" "$TPU_NAME:/tmp/jattn.tar.gz" --worker=all
  rm -f "$archive"
  "${GCLOUD[@]}" ssh "$TPU_NAME" --worker=all --command "
    set -e
    mkdir -p ~/$REMOTE_DIR && tar -xzf /tmp/jattn.tar.gz -C ~/$REMOTE_DIR
    cd ~/$REMOTE_DIR
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/pip install --quiet -e '.[train]' 'jax[tpu]'
  "
fi

args=$(printf ' %q' "$@")
"${GCLOUD[@]}" ssh "$TPU_NAME" --worker=all --command "
  cd ~/$REMOTE_DIR && JATTN_DISTRIBUTED=1 .venv/bin/jattn train --config $CONFIG --workdir $WORKDIR$args
"

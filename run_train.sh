#!/usr/bin/env bash
# README command 1: installs what is missing, builds, and trains.
#
#   ./run_train.sh                                          the debug model on the bundled corpus
#   CONFIG_FILE=./configs/llama3_8b.toml ./run_train.sh --training.steps 100
#   ./run_train.sh --training.steps 50 --metrics.log_freq 5  (further arguments override the config)
#
# NGPU (default 1) is the number of training processes, as in torchtitan's run_train.sh (NGPU=4
# starts 4 through `titan launch`; the config's parallelism degrees decide how they split the work).
# COMM_MODE=fake_backend checks a run of NGPU ranks in one process without GPUs, as torchtitan's does:
# here `titan estimate --world-size NGPU` (the config's checks, then a dry run of rank 0's step on the
# meta device: its memory, FLOPs and communication).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NGPU=${NGPU:-1}
CONFIG_FILE=${CONFIG_FILE:-"$ROOT/configs/llama3_debugmodel.toml"}

"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh" titan

cd "$ROOT"
case "${COMM_MODE:-}" in
  "") ;;
  fake_backend)
    echo "run_train.sh: COMM_MODE=fake_backend: titan estimate --world-size $NGPU (no training, no GPU)" >&2
    exec "$ROOT/build/titan" estimate --world-size "$NGPU" --job.config_file "$CONFIG_FILE" "$@" ;;
  *)
    echo "run_train.sh: COMM_MODE='$COMM_MODE' is not supported: COMM_MODE=fake_backend checks a run of NGPU" \
      "ranks in one process (titan estimate); unset COMM_MODE to train" >&2
    exit 2 ;;
esac
if [[ "$NGPU" == 1 ]]; then
  exec "$ROOT/build/titan" train --job.config_file "$CONFIG_FILE" "$@"
fi
# Several processes (one per GPU; on a CPU-only machine, Gloo processes): torchtitan's LOG_RANK
# (default 0) picks whose output is shown.
export LOG_RANK=${LOG_RANK:-0}
exec "$ROOT/build/titan" launch --nproc-per-node "$NGPU" --master-port "${MASTER_PORT:-0}" -- \
  train --job.config_file "$CONFIG_FILE" "$@"

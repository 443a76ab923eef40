#!/usr/bin/env bash
# README command 1: installs what is missing, builds, and trains.
#
#   ./run_train.sh                                          the debug model on the bundled corpus
#   CONFIG_FILE=./configs/llama3_8b.toml ./run_train.sh --training.steps 100
#   ./run_train.sh --training.steps 50 --metrics.log_freq 5  (further arguments override the config)
#
# NGPU (default 1) is the number of training processes, as in torchtitan's run_train.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NGPU=${NGPU:-1}
CONFIG_FILE=${CONFIG_FILE:-"$ROOT/configs/llama3_debugmodel.toml"}

"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh" titan

if [[ "$NGPU" != 1 ]]; then
  echo "run_train.sh: NGPU=$NGPU asks for $NGPU processes, but multi-process training is not supported yet; use NGPU=1" >&2
  exit 1
fi
cd "$ROOT"
exec "$ROOT/build/titan" train --job.config_file "$CONFIG_FILE" "$@"

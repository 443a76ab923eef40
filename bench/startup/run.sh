#!/usr/bin/env bash
# Time to first step (start-up: processes, model built and initialized, sharded, data, optimizer) for
# the given Llama 3 flavors, with 1 process and with FSDP over 2 processes (`titan launch`), median
# of 3 runs each. Every run is stopped as soon as its start-up line is logged, before the step.
#   bench/startup/run.sh [FLAVOR...]        (default: 1B; env TITAN="binary [binary...]", REPS=3, NPROCS="1 2")
# Extra `titan train` options after --, e.g. bench/startup/run.sh 3B -- --training.dtype bfloat16
# Before/after: TITAN="/tmp/titan_before build/titan" runs the two binaries in turns.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
FLAVORS=(); while [[ $# -gt 0 && "$1" != "--" ]]; do FLAVORS+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
[[ ${#FLAVORS[@]} -gt 0 ]] || FLAVORS=(1B)
TITAN="${TITAN:-$ROOT/build/titan}"
if [[ -z "${TITAN_NO_BUILD:-}" && " $TITAN " == *" $ROOT/build/titan "* ]]; then
  flock /tmp/titan-build.lock "$ROOT/scripts/build.sh" titan >/dev/null
fi
# shellcheck disable=SC2086
exec "$ROOT/.venv/bin/python" "$ROOT/bench/startup/measure.py" --titan $TITAN --flavors "${FLAVORS[@]}" \
  --nprocs ${NPROCS:-1 2} --reps "${REPS:-3}" -- "$@"

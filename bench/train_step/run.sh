#!/usr/bin/env bash
# CPU training step: titan vs an equivalent PyTorch eager loop, same model, batch, sequence length,
# optimizer and thread count, measured in one run (alternating, several rounds; medians).
# usage: bench/train_step/run.sh [batch] [seq_len] [steps] [rounds]   (env THREADS, default nproc)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
B=${1:-4} S=${2:-256} N=${3:-10} R=${4:-3}
export OMP_NUM_THREADS=${THREADS:-$(nproc)}
"$ROOT/scripts/build.sh" titan_bench_train_step >/dev/null
for r in $(seq "$R"); do
  "$ROOT/build/titan_bench_train_step" "$B" "$S" "$N" 3
  "$ROOT/.venv/bin/python" "$ROOT/bench/train_step/pytorch_train_step.py" "$B" "$S" "$N" 3
done | "$ROOT/.venv/bin/python" "$ROOT/bench/train_step/summarize.py"

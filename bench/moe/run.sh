#!/usr/bin/env bash
# One MoE layer's CPU training step: titan with grouped matmuls, titan with one matmul per expert,
# and PyTorch eager written as torchtitan's layer, same shapes and thread count, alternating rounds.
# usage: bench/moe/run.sh [tokens dim hidden experts top_k steps rounds]   (env THREADS, default nproc)
# The default is a Qwen3-30B-A3B layer (dim 2048, hidden 768, 128 experts, top 8) scaled to the CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
T=${1:-2048} D=${2:-512} F=${3:-192} E=${4:-32} K=${5:-4} N=${6:-10} R=${7:-3}
export OMP_NUM_THREADS=${THREADS:-$(nproc)}
"$ROOT/scripts/build.sh" titan_moe_bench >/dev/null
for r in $(seq "$R"); do
  "$ROOT/build/titan_moe_bench" "$T" "$D" "$F" "$E" "$K" "$N"
  "$ROOT/.venv/bin/python" "$ROOT/bench/moe/pytorch_moe.py" "$T" "$D" "$F" "$E" "$K" "$N"
done | "$ROOT/.venv/bin/python" "$ROOT/bench/moe/summarize.py"

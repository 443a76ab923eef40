#!/usr/bin/env bash
# One MoE layer's training step: titan with grouped matmuls, titan with one matmul per expert,
# and PyTorch eager written as torchtitan's layer, same shapes and thread count, alternating rounds.
# usage: bench/moe/run.sh [tokens dim hidden experts top_k steps rounds]   (env THREADS, default nproc)
# The default is a Qwen3-30B-A3B layer (dim 2048, hidden 768, 128 experts, top 8) scaled to the CPU.
# DEVICE=cuda: on the GPU in bf16 (a CUDA build in build/, scripts/build.sh's); the summary adds the
# experts' matmul throughput (18 T K D F FLOPs a step: three matmuls forward, six backward).
# On the GPU, e.g.: DEVICE=cuda bench/moe/run.sh 16384 2048 768 128 8 20 3 (BUILD=0: build/titan_moe_bench as it is)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
T=${1:-2048} D=${2:-512} F=${3:-192} E=${4:-32} K=${5:-4} N=${6:-10} R=${7:-3}
export OMP_NUM_THREADS=${THREADS:-$(nproc)}
DEVICE=${DEVICE:-cpu}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
[[ -x "$ROOT/build/titan_moe_bench" && "${BUILD:-1}" == 0 ]] || "$ROOT/scripts/build.sh" titan_moe_bench >/dev/null
for r in $(seq "$R"); do
  "$ROOT/build/titan_moe_bench" "$T" "$D" "$F" "$E" "$K" "$N" "$DEVICE"
  "$PY" "$ROOT/bench/moe/pytorch_moe.py" "$T" "$D" "$F" "$E" "$K" "$N" "$DEVICE"
done | "$PY" "$ROOT/bench/moe/summarize.py" $((18 * T * K * D * F))

#!/usr/bin/env bash
# FSDP training step on CPU: one collective per unit (flat buffers) vs one per parameter, same model
# and processes, alternating in one run; prints the medians and their ratio.
#   bench/fsdp/run.sh [FLAVOR] [BATCH] [SEQ] [STEPS] [ROUNDS] [NPROC]   (default debugmodel 2 256 8 3 2)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FLAVOR="${1:-debugmodel}" B="${2:-2}" S="${3:-256}" N="${4:-8}" R="${5:-3}" P="${6:-2}"
flock /tmp/titan-build.lock "$ROOT/scripts/build.sh" titan_fsdp_bench >/dev/null 2>&1 || "$ROOT/scripts/build.sh" titan_fsdp_bench >/dev/null
export OMP_NUM_THREADS=1 MASTER_PORT=$((29600 + RANDOM % 1000)) WORLD_SIZE="$P"
out=$(mktemp)
for r in $(seq 1 $((P - 1))); do RANK=$r "$ROOT/build/titan_fsdp_bench" "$FLAVOR" "$B" "$S" "$N" "$R" >/dev/null & done
RANK=0 "$ROOT/build/titan_fsdp_bench" "$FLAVOR" "$B" "$S" "$N" "$R" | tee "$out"
wait
python3 - "$out" <<'PY'
import re, statistics, sys
t = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) round \d+: median step ([0-9.]+) s", line)
    if m: t.setdefault(m.group(1), []).append(float(m.group(2)))
u, p = statistics.median(t["per-unit"]), statistics.median(t["per-parameter"])
print(f"median over rounds: per-unit {u:.4f} s, per-parameter {p:.4f} s; per-parameter / per-unit = {p / u:.3f}")
PY
rm -f "$out"

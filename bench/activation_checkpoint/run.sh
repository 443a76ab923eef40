#!/usr/bin/env bash
# Activation checkpointing: peak memory (the log line's figure: the counting allocator's peak on CPU,
# the caching allocator's on CUDA) and step time of each mode, same model, batch and sequence, modes
# alternating in one run; the step-time cost of recomputation is each mode's median over "none"'s.
# Modes: none, selective:2 (1 block in 2), selective:op (per operator, torchtitan's policy: every
# other matmul kept), selective:op_all (per operator, every matmul kept), full.
#   bench/activation_checkpoint/run.sh [SEQ] [BATCH] [STEPS] [ROUNDS] [FLAVOR]   (default 1024 4 6 3 debugmodel)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SEQ="${1:-1024}" B="${2:-4}" STEPS="${3:-6}" ROUNDS="${4:-3}" FLAVOR="${5:-debugmodel}"
flock /tmp/titan-build.lock "$ROOT/scripts/build.sh" titan >/dev/null 2>&1 || "$ROOT/scripts/build.sh" titan >/dev/null
out=$(mktemp -d)
for r in $(seq "$ROUNDS"); do
  for mode in none selective:2 selective:op selective:op_all full; do
    m="${mode%%:*}"; opt="${mode#*:}"; [ "$opt" = "$mode" ] && opt=2
    policy=every_other_matmul; [ "$opt" = op_all ] && { opt=op; policy=all_matmuls; }
    "$ROOT/build/titan" train --job.config_file "$ROOT/configs/llama3_debugmodel.toml" --model.flavor "$FLAVOR" \
      --job.dump_folder "$out/run" --training.seq_len "$SEQ" --training.local_batch_size "$B" \
      --training.steps "$STEPS" --metrics.log_freq 1 --activation_checkpoint.mode "$m" \
      --activation_checkpoint.selective_ac_option "$opt" --activation_checkpoint.per_op_policy "$policy" 2>&1 |
      sed "s/^/$mode /" >> "$out/log"
  done
done
python3 - "$out/log" "$SEQ" "$B" "$FLAVOR" <<'PY'
import re, statistics, sys
log, seq, batch, flavor = sys.argv[1:]
step_s, peak = {}, {}
for line in open(log):
    mode = line.split(" ", 1)[0]
    m = re.search(r"step:\s*(\d+).*memory:\s*([\d.]+)GiB.*tps:\s*([\d,]+)", line)
    if not m: continue
    step, mem, tps = int(m.group(1)), float(m.group(2)), float(m.group(3).replace(",", ""))
    peak[mode] = max(peak.get(mode, 0.0), mem)
    if step > 1: step_s.setdefault(mode, []).append(int(seq) * int(batch) / tps)
base = statistics.median(step_s["none"])
print(f"llama3 {flavor}, seq_len {seq}, local batch {batch}, CPU (medians over steps 2+ of every round)")
print(f"{'mode':17} {'peak GiB':>9} {'step s':>8} {'step vs none':>13}")
for mode in ["none", "selective:2", "selective:op", "selective:op_all", "full"]:
    s = statistics.median(step_s[mode])
    print(f"{mode:17} {peak[mode]:9.2f} {s:8.3f} {s / base:13.3f}")
PY
rm -rf "$out"

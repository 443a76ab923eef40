#!/usr/bin/env bash
# Checkpoint saves under HSDP 2 x 2 with AdamW state (the debug model, 4 processes on Gloo): the bytes
# each rank writes (replicated pieces are spread over the replicas) and how long a save blocks the
# training loop, synchronous and in the background.
#   bench/checkpoint/hsdp.sh [DIR] [STEPS] [INTERVAL]      (default: ./outputs/bench-hsdp, 30, 5)
# The blocking time of a save is the interval between the log lines of a saving step and the next
# step, less the median interval of the steps that do not save.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:-$ROOT/outputs/bench-hsdp}"; STEPS="${2:-30}"; INTERVAL="${3:-5}"
"$ROOT/scripts/build.sh" titan >/dev/null
mkdir -p "$DIR"
for mode in disabled async; do
  rm -rf "$DIR/$mode"
  OMP_NUM_THREADS=1 "$ROOT/build/titan" launch --nproc-per-node 4 -- train \
    --job.config_file "$ROOT/configs/llama3_debugmodel.toml" --job.dump_folder "$DIR/$mode" \
    --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2 \
    --training.steps "$STEPS" --training.local_batch_size 2 --training.seq_len 256 --metrics.log_freq 1 \
    --checkpoint.enable --checkpoint.interval "$INTERVAL" --checkpoint.async_mode "$mode" \
    --checkpoint.last_save_model_only false --checkpoint.keep_latest_k 0 > "$DIR/$mode.log" 2>&1
  "$ROOT/.venv/bin/python" - "$DIR/$mode.log" "$DIR/$mode/checkpoint/step-$STEPS" "$INTERVAL" "$STEPS" "$mode" <<'PY'
import datetime, os, re, statistics, sys
log, step_dir, interval, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
times = {}
for line in open(log):
    m = re.search(r"\[rank 0\]: \[titan\] (\S+ \S+) - root - INFO - step:\s+(\d+)", line)
    if m:
        times[int(m.group(2))] = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
gaps = {s: (times[s + 1] - times[s]).total_seconds() for s in times if s + 1 in times and s > 1}
plain = statistics.median(g for s, g in gaps.items() if s % interval)
blocked = [gaps[s] - plain for s in sorted(gaps) if s % interval == 0]
sizes = sorted((f, os.path.getsize(os.path.join(step_dir, f))) for f in os.listdir(step_dir) if f.endswith(".safetensors"))
total = sum(b for _, b in sizes)
print(f"{mode}: step {plain * 1000:.0f} ms (median of steps without a save); a save blocks the loop "
      f"{statistics.median(blocked) * 1000:.0f} ms (median of {len(blocked)}: " + ", ".join(f"{b * 1000:.0f}" for b in blocked) + " ms)")
print(f"  per-rank bytes written at step {steps}: " + ", ".join(f"{f.split('.')[0]} {b / 1e6:.2f} MB" for f, b in sizes) +
      f" (total {total / 1e6:.2f} MB, largest/smallest {max(b for _, b in sizes) / min(b for _, b in sizes):.3f})")
PY
done

#!/usr/bin/env bash
# Checkpoint benchmark: titan's save/load throughput and loop blocking vs the disk's own write speed.
#   bench/checkpoint/run.sh [DIR] [FLAVOR] [REPS]     (default: ./outputs/bench, 1B, 3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:-$ROOT/outputs/bench}"; FLAVOR="${2:-1B}"; REPS="${3:-3}"
mkdir -p "$DIR"
"$ROOT/scripts/build.sh" titan_checkpoint_bench >/dev/null
echo "# disk: dd of 4 GiB with fsync on $(df -h "$DIR" | tail -1 | awk '{print $1}')"
for i in $(seq "$REPS"); do
  dd if=/dev/zero of="$DIR/dd.bin" bs=64M count=64 conv=fsync 2>&1 | tail -1
  rm -f "$DIR/dd.bin"
done
"$ROOT/build/titan_checkpoint_bench" --dir "$DIR" --flavor "$FLAVOR" --reps "$REPS"

#!/usr/bin/env bash
# Checkpoint benchmark: titan's save/load throughput and loop blocking vs the disk's own write speed.
#   bench/checkpoint/run.sh [DIR] [FLAVOR] [REPS]     (default: ./outputs/bench, 1B, 3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:-$ROOT/outputs/bench}"; FLAVOR="${2:-1B}"; REPS="${3:-3}"
mkdir -p "$DIR"
"$ROOT/scripts/build.sh" titan_checkpoint_bench >/dev/null
# The disk's own speed in the bench's pattern: two 4 GiB files of random bytes written back to back
# with fsync (a save follows another save); the second one is the figure to compare with.
echo "# disk: dd of 4 GiB random bytes with fsync, twice in a row, on $(df -h "$DIR" | tail -1 | awk '{print $1}')"
head -c 4294967296 /dev/urandom > "$DIR/random.bin"
for i in $(seq "$REPS"); do
  dd if="$DIR/random.bin" of="$DIR/dd1.bin" bs=64M conv=fsync 2>&1 | tail -1 | sed 's/^/first:  /'
  dd if="$DIR/random.bin" of="$DIR/dd2.bin" bs=64M conv=fsync 2>&1 | tail -1 | sed 's/^/second: /'
  rm -f "$DIR/dd1.bin" "$DIR/dd2.bin"
done
rm -f "$DIR/random.bin"
"$ROOT/build/titan_checkpoint_bench" --dir "$DIR" --flavor "$FLAVOR" --reps "$REPS"

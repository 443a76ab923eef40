#!/usr/bin/env bash
# The tests that exercise CUDA, for a machine with one GPU (a CUDA build of titan in build/): the
# CUDA parity cases, attention's CUDA block kernel, FSDP at world size 1, CPU offload, deterministic
# repeatability, allocator snapshots read by PyTorch's memory_viz, out-of-memory errors, NCCL's
# presence, and the single-process training and CLI tests (which train on the GPU when one is
# visible). Launched tests of several ranks need a GPU per rank, so they are not in this list.
# usage: scripts/gpu_tests.sh [parallel shards, default 6]   (env TIMEOUT: seconds per shard, 600)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARDS=${1:-6}
FILTER='*Llama3Parity.*:DataParallel.FsdpWorldOne*:C10d.*:MemorySnapshot.*:InitSlices.*:CudaAttention.*'
FILTER+=':CudaTraining.*:Trainer.*:TitanTrain.*:Profiling.OutOfMemoryWritesTheSnapshotAndNamesIt'
FILTER+=':Validation.LossEqualsTheReferenceOnTheSameTokens:LocalDevice.*'
LOGS=$(mktemp -d)
for i in $(seq 0 $((SHARDS - 1))); do
  GTEST_TOTAL_SHARDS=$SHARDS GTEST_SHARD_INDEX=$i timeout "${TIMEOUT:-600}" "$ROOT/build/titan_tests" \
    --gtest_filter="$FILTER" > "$LOGS/shard$i.log" 2>&1 &
done
wait
cat "$LOGS"/shard*.log > "$LOGS/all.log"
grep -hE '^\[(offload|block|merged)|^\[[a-z]+/cuda|memory_viz:' "$LOGS/all.log"
passed=$(grep -c '^\[       OK \]' "$LOGS/all.log")
skipped=$(grep -cE '^\[  SKIPPED \] .*\([0-9]+ ms\)' "$LOGS/all.log")
failed=$(grep -E '^\[  FAILED  \] .*\([0-9]+ ms\)' "$LOGS/all.log" | sed 's/, where GetParam.*//')
echo "[gpu_tests] $passed passed, $skipped skipped; log: $LOGS/all.log"
if [[ -n "$failed" ]]; then echo "$failed"; exit 1; fi
started=$(grep -c '^\[ RUN      \]' "$LOGS/all.log")
if (( started != passed + skipped )); then echo "[gpu_tests] $((started - passed - skipped)) tests did not finish (TIMEOUT?)"; exit 1; fi

#!/usr/bin/env bash
# The tests that exercise CUDA, for a machine with one GPU (a CUDA build of titan in build/): the
# CUDA parity cases, titan's fused kernels (and their arithmetic), attention's CUDA block kernel, FSDP
# at world size 1, CPU offload, deterministic repeatability, initialization on the GPU, allocator
# snapshots read by PyTorch's memory_viz, out-of-memory errors, NCCL's presence, float8 products and
# casts against the CPU's, MoE grouped matmuls, steps between log steps without a host wait, and the
# in-process training tests (which train on the GPU when one is visible). Processes the tests start (titan runs
# of several ranks, references) see no GPU unless a test hands them one, so with --all the rest of
# the suite follows through ctest, as on a machine without a GPU.
# usage: scripts/gpu_tests.sh [--all] [parallel shards, default 6]   (env TIMEOUT: seconds per shard, 600)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ALL=0
if [[ "${1:-}" == --all ]]; then ALL=1; shift; fi
SHARDS=${1:-6}
FILTER='*Llama3Parity.*cuda*:DataParallel.FsdpWorldOne*:C10d.*:MemorySnapshot.*:InitSlices.*:CudaAttention.*'
FILTER+=':CudaTraining.*:Trainer.*:TitanTrain.*:Profiling.OutOfMemoryWritesTheSnapshotAndNamesIt'
FILTER+=':Validation.LossEqualsTheReferenceOnTheSameTokens:LocalDevice.*:CudaFusedKernels.*:FusedMath.*:InitPhilox.*:CudaFloat8.*:CudaMoE.*'
# The reference tests' Python: the set-up's .venv, else the machine's python3 (a GPU machine's CUDA torch).
if [[ ! -x "$ROOT/.venv/bin/python" && -z "${TITAN_TEST_PYTHON:-}" ]]; then
  TITAN_TEST_PYTHON=$(command -v python3) && export TITAN_TEST_PYTHON
fi
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
status=0
if [[ -n "$failed" ]]; then echo "$failed"; status=1; fi
started=$(grep -c '^\[ RUN      \]' "$LOGS/all.log")
nfailed=$(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)' "$LOGS/all.log")
unfinished=$((started - passed - skipped - nfailed))
if (( unfinished )); then echo "[gpu_tests] $unfinished tests did not finish (TIMEOUT?)"; status=1; fi
if (( ALL )); then
  # ctest names tests Suite.Name (parameterized: Prefix/Suite.Name/Index); the filter's patterns as regexes.
  exclude=$(sed -e 's/[.]/[.]/g' -e 's/[*]/.*/g' -e 's/:/|/g' <<< "$FILTER")
  # On the CPU, as in CI: in-process training compares with runs the tests start, which see no GPU.
  (cd "$ROOT/build" && CUDA_VISIBLE_DEVICES= ctest --output-on-failure --timeout 900 -j "$(nproc)" -E "^($exclude)$") ||
    status=1
fi
exit "$status"

#!/usr/bin/env bash
# Pipeline schedules on CPU: each rank's busy and idle time per step, measured, against the schedule's
# theoretical bubble, and the activation memory each schedule holds. For every pp degree and schedule,
# starts pp processes of titan_pipeline_bench on the debug model with torchrun's environment variables
# (as `titan launch` sets them; it starts only titan's own subcommands), one thread each, then prints
# one markdown table per pp (titan_pipeline_bench --summarize).
#   bench/pipeline/run.sh [PP_DEGREES] [SEQ] [WARMUP] [MEASURE] [ROUNDS]   (default "4 2" 512 2 8 2)
# Rounds alternate the schedules (round 1: every schedule, then round 2, ...), so that a change of the
# machine's load falls on all of them; each figure is the median over rounds.
#   env SCHEDULES="GPipe 1F1B ..." to choose the schedules, EXTRA="--section.key value ..." to add options,
#   OUT_DIR=DIR to keep the ranks' JSON files and logs (default: a temporary folder, removed).
# Every schedule runs 8 microbatches of 1 sequence (local_batch_size 8, microbatch size 1), without
# activation checkpointing (so the activation figures are what the schedule keeps in flight).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PPS="${1:-4 2}" SEQ="${2:-512}" WARMUP="${3:-2}" MEASURE="${4:-8}" ROUNDS="${5:-2}"
SCHEDULES="${SCHEDULES:-GPipe 1F1B Interleaved1F1B InterleavedZeroBubble ZBVZeroBubble}"
LOCK=/tmp/titan-build.lock  # builds on a shared machine take it; measurements too, so none runs during one
flock "$LOCK" "$ROOT/scripts/build.sh" titan titan_pipeline_bench >/dev/null
BIN="$ROOT/build/titan_pipeline_bench"
if [[ -n "${OUT_DIR:-}" ]]; then OUT="$OUT_DIR"; mkdir -p "$OUT"; else OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT; fi
cd "$ROOT"  # the config's tokenizer and dataset paths are relative to the repository

run_schedule() {  # pp schedule round
  local pp=$1 s=$2 round=$3 port=$((29600 + RANDOM % 1000)) pids=() r
  for r in $(seq 0 $((pp - 1))); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$pp LOCAL_WORLD_SIZE=$pp MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
      "$BIN" --warmup "$WARMUP" --measure "$MEASURE" --round "$round" --out "$OUT/pp${pp}_$s" \
      --job.config_file configs/llama3_debugmodel.toml --job.dump_folder "$OUT/dump" \
      --parallelism.pipeline_parallel_degree "$pp" --parallelism.data_parallel_shard_degree 1 \
      --parallelism.pipeline_parallel_schedule "$s" --parallelism.pipeline_parallel_microbatch_size 1 \
      --training.local_batch_size 8 --training.seq_len "$SEQ" --activation_checkpoint.mode none \
      ${EXTRA:-} >"$OUT/pp${pp}_$s.round$round.rank$r.log" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for r in "${!pids[@]}"; do wait "${pids[$r]}" || failed=1; done
  if ((failed)); then
    echo "pp $pp $s round $round failed:" >&2
    tail -n 5 "$OUT"/pp"${pp}"_"$s".round"$round".rank*.log >&2
    exit 1
  fi
}

exec 9>"$LOCK"
echo "# $(date -u +%F), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) before"
for pp in $PPS; do
  for round in $(seq 1 "$ROUNDS"); do
    for s in $SCHEDULES; do
      start=$(date +%s)
      flock 9  # held while the ranks run, released before the next schedule (builds waiting get a turn)
      run_schedule "$pp" "$s" "$round"
      flock -u 9
      echo "pp $pp round $round $s: $(($(date +%s) - start)) s, load average $(cut -d' ' -f1 /proc/loadavg)"
    done
  done
done
echo "# load average $(cut -d' ' -f1-3 /proc/loadavg) after"
"$BIN" --summarize "$OUT"/*.json

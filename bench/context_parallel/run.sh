#!/usr/bin/env bash
# Context parallelism on CPU, measured: (1) the longest sequence one rank can train within a fixed
# memory budget, without CP and with CP 2 and 4; (2) the step-time overhead of ring attention
# against one process doing the same total work.
#   bench/context_parallel/run.sh [BUDGET_MB] [CP_DEGREES] [SEQ] [STEPS] [ROUNDS]
#   defaults:                      160         "1 2 4"      2048  6       3
# (1) For every degree, trains the debug model (batch 1, the config's selective activation
# checkpointing) for 2 steps at growing sequence lengths (doubling from 512, then bisecting to a
# multiple of 256) and reads each rank's peak CPU memory of step 2 from its memory snapshot
# (profiling.enable_memory_snapshot): the longest length whose largest rank stays within the budget.
# Under CP the peak includes FSDP's shards over the cp ranks, as a user's run would.
# (2) At SEQ tokens and batch 1, the median step time (steps 2..STEPS, from metrics.jsonl) without
# CP and with each degree and rotate method, in ROUNDS alternating rounds (each figure the median
# over rounds). Core-seconds per step = step time x min(cp, cores): the same total work costs
# cp processes' time, so their ratio to one process is the ring's overhead (communication, the
# merge, the smaller blocks). With more processes than cores the ratio also holds their contention.
#   env OUT_DIR=DIR keeps every run's folder (default: a temporary folder, removed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUDGET_MB="${1:-160}" CPS="${2:-1 2 4}" SEQ="${3:-2048}" STEPS="${4:-6}" ROUNDS="${5:-3}"
LOCK=/tmp/titan-build.lock
flock "$LOCK" "$ROOT/scripts/build.sh" titan >/dev/null
TITAN="$ROOT/build/titan"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY=python3
if [[ -n "${OUT_DIR:-}" ]]; then OUT="$OUT_DIR"; mkdir -p "$OUT"; else OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT; fi
cd "$ROOT"
CORES=$(nproc)

train() {  # dump cp seq steps [extra options...]: trains, fails loudly
  local dump=$1 cp=$2 seq=$3 steps=$4
  shift 4
  local args=(train --job.config_file configs/llama3_debugmodel.toml --job.dump_folder "$dump" --training.seq_len "$seq"
              --training.local_batch_size 1 --training.global_batch_size 1 --training.steps "$steps" --metrics.log_freq 1 "$@")
  rm -rf "$dump"
  if ((cp > 1)); then
    OMP_NUM_THREADS=1 "$TITAN" launch --nproc-per-node "$cp" --master-port 0 -- "${args[@]}" \
      --parallelism.context_parallel_degree "$cp" --parallelism.data_parallel_shard_degree 1 >"$dump.log" 2>&1
  else
    OMP_NUM_THREADS=1 "$TITAN" "${args[@]}" >"$dump.log" 2>&1
  fi || { echo "run failed: cp $cp seq $seq $*" >&2; tail -n 5 "$dump.log" >&2; exit 1; }
}

peak_mb() {  # dump cp: the largest rank's peak CPU memory of step 2, MB
  "$PY" - "$1" "$2" <<'PYEOF'
import json, sys
d, cp = sys.argv[1], int(sys.argv[2])
print(max(json.load(open(f"{d}/memory_snapshot/iteration_2/rank{r}_cpu_memory.json"))["peak_bytes"] for r in range(cp)) / 1e6)
PYEOF
}

fits() {  # cp seq: whether training at seq stays within the budget (prints the peak)
  local dump="$OUT/fit_cp$1_seq$2"
  train "$dump" "$1" "$2" 2 --profiling.enable_memory_snapshot --profiling.profile_freq 2
  local mb
  mb=$(peak_mb "$dump" "$1")
  echo "  cp $1 seq $2: peak $mb MB" >&2
  "$PY" -c "import sys; sys.exit(0 if $mb <= $BUDGET_MB else 1)"
}

exec 9>"$LOCK"
flock 9  # no build runs while measuring
echo "# $(date -u +%F), $CORES cores, load average $(cut -d' ' -f1-3 /proc/loadavg) before"
echo
echo "## Longest sequence within $BUDGET_MB MB per rank (debug model, batch 1)"
echo
echo "| cp | longest seq_len | peak at that length (MB) | vs cp 1 |"
echo "|---|---|---|---|"
base=""
for cp in $CPS; do
  step=$((2 * cp > 256 ? 2 * cp : 256))
  good=0 bad=0 seq=512
  while fits "$cp" "$seq"; do good=$seq; seq=$((seq * 2)); done
  bad=$seq
  while ((bad - good > step)); do
    mid=$(((good + bad) / 2 / step * step))
    ((mid > good)) || break
    if fits "$cp" "$mid"; then good=$mid; else bad=$mid; fi
  done
  if ((good == 0)); then echo "| $cp | < 512 | - | - |"; continue; fi
  train "$OUT/best_cp$cp" "$cp" "$good" 2 --profiling.enable_memory_snapshot --profiling.profile_freq 2
  [[ -n "$base" ]] || base=$good
  echo "| $cp | $good | $(peak_mb "$OUT/best_cp$cp" "$cp") | x$("$PY" -c "print(round($good / $base, 2))") |"
done

echo
echo "## Step time at seq_len $SEQ, batch 1: one process vs CP (median over $ROUNDS rounds)"
echo
for round in $(seq 1 "$ROUNDS"); do
  train "$OUT/time_cp1_r$round" 1 "$SEQ" "$STEPS"
  for cp in $CPS; do
    ((cp > 1)) || continue
    for method in allgather alltoall; do
      train "$OUT/time_cp${cp}_${method}_r$round" "$cp" "$SEQ" "$STEPS" --parallelism.context_parallel_rotate_method "$method"
    done
  done
done
"$PY" - "$OUT" "$CORES" "$CPS" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
out, cores, cps, rounds = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3].split()], int(sys.argv[4])
def step_time(d):
    t = [json.loads(l)["time"] for l in open(f"{d}/metrics.jsonl") if '"kind":"train"' in l]
    return statistics.median(b - a for a, b in zip(t, t[1:]))  # steps 2.. (step 1 holds the warm-up)
one = statistics.median(step_time(f"{out}/time_cp1_r{r}") for r in range(1, rounds + 1))
print("| layout | step time (s) | core-seconds per step | vs one process |")
print("|---|---|---|---|")
print(f"| one process | {one:.3f} | {one:.3f} | 1.00 |")
for cp in cps:
    if cp == 1: continue
    for m in ("allgather", "alltoall"):
        t = statistics.median(step_time(f"{out}/time_cp{cp}_{m}_r{r}") for r in range(1, rounds + 1))
        cs = t * min(cp, cores)
        print(f"| cp {cp}, {m} | {t:.3f} | {cs:.3f} | {cs / one:.2f} |")
PYEOF
echo
echo "# load average $(cut -d' ' -f1-3 /proc/loadavg) after"

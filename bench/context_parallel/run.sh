#!/usr/bin/env bash
# Context parallelism on CPU, measured: (1) the longest sequence one rank can train within a fixed
# memory budget, without CP and with CP 2 and 4; (2) the step-time overhead of ring attention
# against one process doing the same total work.
#   bench/context_parallel/run.sh [BUDGET_MB] [CP_DEGREES] [SEQ] [STEPS] [ROUNDS] [PART]
#   defaults:                      160         "1 2 4"      2048  6       3        "memory time"
# (1) For every degree, trains the debug model (batch 1, the config's selective activation
# checkpointing) for 2 steps at growing sequence lengths (doubling from 512, then bisecting to a
# multiple of 256) and reads each rank's peak CPU memory of step 2 from its memory snapshot
# (profiling.enable_memory_snapshot): the longest length whose largest rank stays within the budget.
# Under CP the peak includes FSDP's shards over the cp ranks, as a user's run would.
# (2) At SEQ tokens, for each degree cp > 1, the same global batch of cp sequences trained three
# ways: one process; FSDP over cp ranks (one sequence each); CP over cp ranks (every sequence split,
# FSDP over the same cp ranks), with each rotate method. The median step time (steps 2..STEPS, from
# metrics.jsonl) over ROUNDS alternating rounds. Core-seconds per step = step time x min(ranks,
# cores). CP against FSDP at the same degree isolates the ring (both move the same parameters and
# gradients); against one process it is the whole cost of spreading the work. With more processes
# than cores the figures also hold their contention.
#   env OUT_DIR=DIR keeps every run's folder (default: a temporary folder, removed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUDGET_MB="${1:-160}" CPS="${2:-1 2 4}" SEQ="${3:-2048}" STEPS="${4:-6}" ROUNDS="${5:-3}" PART="${6:-memory time}"
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
if [[ " $PART " == *" memory "* ]]; then
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
  echo "| $cp | $good | $("$PY" -c "print(round($(peak_mb "$OUT/best_cp$cp" "$cp"), 1))") | x$("$PY" -c "print(round($good / $base, 2))") |"
done
fi

if [[ " $PART " == *" time "* ]]; then
echo
echo "## Step time at seq_len $SEQ: the same global batch of cp sequences (median over $ROUNDS rounds)"
echo
timed() {  # name ranks global_batch local_batch [options...]
  local name=$1 n=$2 gb=$3 lb=$4
  shift 4
  local dump="$OUT/$name" args=(train --job.config_file configs/llama3_debugmodel.toml --job.dump_folder "$OUT/$name"
    --training.seq_len "$SEQ" --training.local_batch_size "$lb" --training.global_batch_size "$gb"
    --training.steps "$STEPS" --metrics.log_freq 1 "$@")
  rm -rf "$dump"
  if ((n > 1)); then
    OMP_NUM_THREADS=1 "$TITAN" launch --nproc-per-node "$n" --master-port 0 -- "${args[@]}" >"$dump.log" 2>&1
  else
    OMP_NUM_THREADS=1 "$TITAN" "${args[@]}" >"$dump.log" 2>&1
  fi || { echo "run failed: $name" >&2; tail -n 5 "$dump.log" >&2; exit 1; }
}
for round in $(seq 1 "$ROUNDS"); do
  for cp in $CPS; do
    ((cp > 1)) || continue
    timed "one_b${cp}_r$round" 1 "$cp" "$cp"
    timed "fsdp${cp}_r$round" "$cp" "$cp" 1 --parallelism.data_parallel_shard_degree "$cp"
    for method in allgather alltoall; do
      timed "cp${cp}_${method}_r$round" "$cp" "$cp" "$cp" --parallelism.context_parallel_degree "$cp" \
        --parallelism.data_parallel_shard_degree 1 --parallelism.context_parallel_rotate_method "$method"
    done
  done
done
"$PY" - "$OUT" "$CORES" "$CPS" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
out, cores, cps, rounds = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3].split()], int(sys.argv[4])
def step_time(name):
    def one(d):
        t = [json.loads(l)["time"] for l in open(f"{d}/metrics.jsonl") if '"kind":"train"' in l]
        return statistics.median(b - a for a, b in zip(t, t[1:]))  # steps 2.. (step 1 holds the warm-up)
    return statistics.median(one(f"{out}/{name}_r{r}") for r in range(1, rounds + 1))
print("| layout | ranks | step time (s) | core-seconds per step | vs one process | vs FSDP |")
print("|---|---|---|---|---|---|")
for cp in cps:
    if cp == 1: continue
    one = step_time(f"one_b{cp}")
    fsdp = step_time(f"fsdp{cp}") * min(cp, cores)
    print(f"| one process, batch {cp} | 1 | {one:.3f} | {one:.3f} | 1.00 | |")
    print(f"| FSDP {cp}, 1 sequence per rank | {cp} | {fsdp / min(cp, cores):.3f} | {fsdp:.3f} | {fsdp / one:.2f} | 1.00 |")
    for m in ("allgather", "alltoall"):
        t = step_time(f"cp{cp}_{m}")
        cs = t * min(cp, cores)
        print(f"| CP {cp} ({m}), every sequence split | {cp} | {t:.3f} | {cs:.3f} | {cs / one:.2f} | {cs / fsdp:.2f} |")
PYEOF
fi
echo
echo "# load average $(cut -d' ' -f1-3 /proc/loadavg) after"

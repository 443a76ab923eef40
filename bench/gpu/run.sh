#!/usr/bin/env bash
# One GPU, side by side: titan (`titan train`, the binary users run) and torchtitan (its released
# wheel: its own Llama 3 model and single-GPU train step, eager and with per-block torch.compile) on
# the same GPU in one run, same shapes, batch 1, seq_len 8192, bf16 autocast over fp32 weights, no
# activation checkpointing: the 1B flavor and Llama 3 8B-shaped layers (dim 4096, N layers).
# Prints tokens/s, MFU, peak memory and seconds from launch to the first step, one JSON line per run,
# then a table. Needs a CUDA build of titan in build/ and torchtitan importable by python3
# (pip install torchtitan==0.2.2 and its dependencies).
# usage: bench/gpu/run.sh [layers of the 8B-shaped model, default 16] [steps, default 15]
# Environment: TITAN_BINS, titan binaries to compare (default build/titan; several, space-separated:
# each runs as its own row, "titan:<name>", ratios against the first); TORCHTITAN=0 skips torchtitan;
# FLOAT8="tensorwise rowwise" (or one of them) adds, per model and recipe, float8 rows of titan
# (quantize.linear.float8, filter_fqns output) and torchtitan (its converter: torchao's Float8Linear,
# so torchao must be importable too), ratios against titan's float8 row; MODELS="1B 8B" (default)
# or one of them; TT_MODES="eager compile" (default) or one of them: torchtitan's rows that run.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LAYERS=${1:-16} STEPS=${2:-15} SEQ=8192 WARMUP=5
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
RESULTS="$WORK/results.jsonl"
hf_llama() {  # $1 hidden, $2 ffn, $3 layers: an HF Llama 3 config.json, embeddings untied
  printf '{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":%d,"intermediate_size":%d,"num_hidden_layers":%d,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"rope_theta":500000.0,"rms_norm_eps":1e-05,"tie_word_embeddings":false,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192},"max_position_embeddings":131072}' "$1" "$2" "$3"
}

TITAN_BINS=${TITAN_BINS:-build/titan}
read -r -a BINS <<< "$TITAN_BINS"
titan_run() {  # $1 label, $2 flavor, $3... more titan options
  local bin impl label=$1 flavor=$2
  shift 2
  for bin in "${BINS[@]}"; do
    impl=titan
    (( ${#BINS[@]} > 1 )) && impl="titan:$(basename "$bin")"
    titan_one "$label" "$flavor" "$bin" "$impl" "$@"
  done
}
titan_one() {  # $1 label, $2 flavor, $3 binary, $4 impl name, $5... more titan options
  local dump="$WORK/titan_$RANDOM" t0 label=$1 flavor=$2 bin=$3 impl=$4
  shift 4
  t0=$(date +%s.%N)
  (cd "$ROOT" && timeout 150 "$bin" train --job.config_file configs/llama3_debugmodel.toml \
      --model.flavor "$flavor" --training.seq_len $SEQ --training.local_batch_size 1 \
      --training.steps $((WARMUP + STEPS)) --metrics.log_freq 1 --activation_checkpoint.mode none \
      --job.dump_folder "$dump" "$@" > "$dump.log" 2>&1) || { echo "[gpu] $impl $label failed:"; tail -20 "$dump.log"; return; }
  "$PY" - "$dump/metrics.jsonl" "$t0" "$label" "$WARMUP" "$impl" <<'PYEOF' | tee -a "$RESULTS"
import json, statistics, sys
path, t0, label, warmup, impl = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
rows = [json.loads(l) for l in open(path) if l.strip()]
train = [r for r in rows if r.get("kind") == "train"]
timed = [r for r in train if r["step"] > warmup]
tps = statistics.median(r["tps"] for r in timed)
print(json.dumps({"impl": impl, "model": label, "tps": round(tps, 1),
                  "mfu_pct": round(statistics.median((r["mfu_pct"] or 0) for r in timed), 2),
                  "peak_reserved_gib": round(max(r["memory_gib"] for r in train), 2),
                  "launch_to_first_step_s": round(train[0]["time"] - t0, 1),
                  "final_loss": round(train[-1]["loss"], 4)}))
PYEOF
}

tt_run() {  # $1: extra arguments
  [[ "${TORCHTITAN:-1}" == 0 ]] && return
  local mode=eager
  [[ " $* " == *" --compile "* ]] && mode=compile
  [[ " ${TT_MODES:-eager compile} " == *" $mode "* ]] || return 0
  LAUNCH_TIME=$(date +%s.%N) timeout 200 "$PY" "$ROOT/bench/gpu/torchtitan_step.py" --seq $SEQ --steps "$STEPS" \
    --warmup $WARMUP "$@" 2> "$WORK/tt.err" | tee -a "$RESULTS" || { echo "[gpu] torchtitan $* failed:"; tail -20 "$WORK/tt.err"; }
}

float8_rows() {  # $1 label, $2 flavor, $3... torchtitan's shape options
  local label=$1 flavor=$2 recipe
  shift 2
  for recipe in ${FLOAT8:-}; do
    titan_run "$label fp8 $recipe" "$flavor" --model.converters quantize.linear.float8 \
      --quantize.linear.float8.recipe_name "$recipe" --quantize.linear.float8.filter_fqns output
    tt_run "$@" --float8 "$recipe" --label "$label fp8 $recipe"
    tt_run "$@" --float8 "$recipe" --label "$label fp8 $recipe" --compile
  done
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for model in ${MODELS:-1B 8B}; do
  case $model in
    1B) label=1B-shaped flavor=$(hf_llama 2048 8192 16) shape=(--flavor 1B) ;;
    8B) label="8B-shaped x$LAYERS" flavor=$(hf_llama 4096 14336 "$LAYERS") shape=(--layers "$LAYERS") ;;
    *) echo "bench/gpu/run.sh: MODELS holds 1B and/or 8B, not $model" >&2; exit 2 ;;
  esac
  titan_run "$label" "$flavor"
  tt_run "${shape[@]}"
  tt_run "${shape[@]}" --compile
  float8_rows "$label" "$flavor" "${shape[@]}"
done
"$PY" - "$RESULTS" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print(f"{'model':<30} {'impl':<26} {'tokens/s':>9} {'MFU %':>6} {'peak GiB':>9} {'first step s':>12} {'vs titan':>8}")
for r in rows:
    base = next((b for b in rows if b["impl"].startswith("titan") and b["model"] == r["model"]), None)
    ratio = f"{r['tps'] / base['tps']:.3f}" if base else "-"
    print(f"{r['model']:<30} {r['impl']:<26} {r['tps']:>9.0f} {r['mfu_pct']:>6.1f} {r['peak_reserved_gib']:>9.2f} "
          f"{r['launch_to_first_step_s']:>12.1f} {ratio:>8}")
PYEOF

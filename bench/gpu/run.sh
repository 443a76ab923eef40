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
# each runs as its own row, "titan:<name>", ratios against the first); TORCHTITAN=0 skips torchtitan.
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
titan_run() {  # $1 label, $2 flavor
  local bin impl
  for bin in "${BINS[@]}"; do
    impl=titan
    (( ${#BINS[@]} > 1 )) && impl="titan:$(basename "$bin")"
    titan_one "$1" "$2" "$bin" "$impl"
  done
}
titan_one() {  # $1 label, $2 flavor, $3 binary, $4 impl name
  local dump="$WORK/titan_$RANDOM" t0
  t0=$(date +%s.%N)
  (cd "$ROOT" && timeout 150 "$3" train --job.config_file configs/llama3_debugmodel.toml \
      --model.flavor "$2" --training.seq_len $SEQ --training.local_batch_size 1 \
      --training.steps $((WARMUP + STEPS)) --metrics.log_freq 1 --activation_checkpoint.mode none \
      --job.dump_folder "$dump" > "$dump.log" 2>&1) || { echo "[gpu] $4 $1 failed:"; tail -20 "$dump.log"; return; }
  "$PY" - "$dump/metrics.jsonl" "$t0" "$1" "$WARMUP" "$4" <<'PYEOF' | tee -a "$RESULTS"
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
  LAUNCH_TIME=$(date +%s.%N) timeout 200 "$PY" "$ROOT/bench/gpu/torchtitan_step.py" --seq $SEQ --steps "$STEPS" \
    --warmup $WARMUP "$@" 2> "$WORK/tt.err" | tee -a "$RESULTS" || { echo "[gpu] torchtitan $* failed:"; tail -20 "$WORK/tt.err"; }
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
titan_run 1B-shaped "$(hf_llama 2048 8192 16)"
tt_run --flavor 1B
tt_run --flavor 1B --compile
titan_run "8B-shaped x$LAYERS" "$(hf_llama 4096 14336 "$LAYERS")"
tt_run --layers "$LAYERS"
tt_run --layers "$LAYERS" --compile
"$PY" - "$RESULTS" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print(f"{'model':<18} {'impl':<20} {'tokens/s':>9} {'MFU %':>6} {'peak GiB':>9} {'first step s':>12} {'vs titan':>8}")
for r in rows:
    base = next((b for b in rows if b["impl"].startswith("titan") and b["model"] == r["model"]), None)
    ratio = f"{r['tps'] / base['tps']:.3f}" if base else "-"
    print(f"{r['model']:<18} {r['impl']:<20} {r['tps']:>9.0f} {r['mfu_pct']:>6.1f} {r['peak_reserved_gib']:>9.2f} "
          f"{r['launch_to_first_step_s']:>12.1f} {ratio:>8}")
PYEOF

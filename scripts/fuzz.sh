#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang (ASan + UBSan) into build-fuzz/, runs each
# over its regression inputs (tests/fuzz/regressions/<target>/, once each), then fuzzes each for a
# bounded time from its seed corpus (tests/fuzz/corpus/<target>/) plus a work corpus kept in
# build-fuzz/corpus/<target>/. Fails when any target crashes, naming the input that reproduces it.
#
#   scripts/fuzz.sh                      every target, 45 s each (two at a time on two cores)
#   scripts/fuzz.sh --seconds 3600       longer runs
#   scripts/fuzz.sh --target jsonl       one target (repeat --target for several)
#   scripts/fuzz.sh --regressions-only   only replay the regression inputs
#   scripts/fuzz.sh --jobs 1             targets fuzzed at once (default: the number of cores)
#
# Reproduce a crash: build-fuzz/<target>_fuzz <input file>. docs/fuzzing.md has the details.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
ALL_TARGETS=(config tokenizer_hf tokenizer_tiktoken tokenizer_sentencepiece jsonl table token_shards token_files checkpoint dcp pipeline_csv hub_readme)

SECONDS_PER_TARGET=45
JOBS=$(nproc)
REGRESSIONS_ONLY=0
TARGETS=()
while (($#)); do
  case "$1" in
    --seconds) SECONDS_PER_TARGET="$2"; shift 2 ;;
    --target) TARGETS+=("$2"); shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --regressions-only) REGRESSIONS_ONLY=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "[fuzz] ERROR: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
((${#TARGETS[@]})) || TARGETS=("${ALL_TARGETS[@]}")
for t in "${TARGETS[@]}"; do
  [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || { echo "[fuzz] ERROR: no target '$t' (targets: ${ALL_TARGETS[*]})" >&2; exit 2; }
done

# ---------------------------------------------------------------------------------------------- build
CLANG="${FUZZ_CXX:-clang++}"
command -v "$CLANG" >/dev/null || { echo "[fuzz] ERROR: $CLANG not found: run scripts/setup.sh (Debian packages clang, libclang-rt-14-dev)" >&2; exit 1; }
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || { echo "[fuzz] ERROR: $ROOT/.venv is missing: run scripts/setup.sh first" >&2; exit 1; }
export PATH="$ROOT/.venv/bin:$PATH"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
build_start=$(date +%s)
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S "$ROOT/tests/fuzz" -B "$BUILD_DIR" -G Ninja -DCMAKE_CXX_COMPILER="$CLANG" \
    -DTORCH_CMAKE_PREFIX="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
fi
cmake --build "$BUILD_DIR" -- $(printf '%s_fuzz ' "${TARGETS[@]}")
echo "[fuzz] build: $(($(date +%s) - build_start)) s"

# Sanitizer reports abort (so libFuzzer keeps the input); leaks are reported by libFuzzer itself.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# Leaks inside LibTorch's zip reader, not titan's (the file says which).
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$ROOT/tests/fuzz/lsan_suppressions.txt}"
# Limits that turn hangs and unbounded allocations into failures: 10 s per input, 2 GiB of memory,
# 512 MiB in one allocation (a size read from a file must be checked against the file first).
LIMITS=(-timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512)
mkdir -p "$BUILD_DIR/logs"

# ----------------------------------------------------------------------------------------- regressions
failed=()
for t in "${TARGETS[@]}"; do
  dir="$ROOT/tests/fuzz/regressions/$t"
  inputs=()
  [[ -d "$dir" ]] && while IFS= read -r -d '' f; do inputs+=("$f"); done < <(find "$dir" -type f -print0 | sort -z)
  ((${#inputs[@]})) || continue
  if "$BUILD_DIR/${t}_fuzz" "${LIMITS[@]}" "${inputs[@]}" >"$BUILD_DIR/logs/$t.regressions.log" 2>&1; then
    echo "[fuzz] $t: ${#inputs[@]} regression inputs pass"
  else
    echo "[fuzz] FAILED: $t on a regression input (tests/fuzz/regressions/$t/):" >&2
    grep -E "^Running: |ERROR|unexpected exception|fuzz check failed|SUMMARY" "$BUILD_DIR/logs/$t.regressions.log" | tail -8 >&2
    failed+=("$t (regression)")
  fi
done
if ((REGRESSIONS_ONLY)); then
  ((${#failed[@]} == 0)) || { echo "[fuzz] FAILED: ${failed[*]} (logs in $BUILD_DIR/logs/)" >&2; exit 1; }
  exit 0
fi

# ------------------------------------------------------------------------------------------- fuzzing
fuzz_one() {
  local t="$1" work="$BUILD_DIR/corpus/$1" crashes="$BUILD_DIR/crashes/$1"
  mkdir -p "$work" "$crashes"
  "$BUILD_DIR/${t}_fuzz" "${LIMITS[@]}" -max_total_time="$SECONDS_PER_TARGET" -print_final_stats=1 \
    -artifact_prefix="$crashes/" "$work" "$ROOT/tests/fuzz/corpus/$t" >"$BUILD_DIR/logs/$t.log" 2>&1
}
echo "[fuzz] fuzzing ${TARGETS[*]}: $SECONDS_PER_TARGET s each, $JOBS at a time (logs: $BUILD_DIR/logs/)"
declare -A status
pids=()
names=()
for t in "${TARGETS[@]}"; do
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
  fuzz_one "$t" &
  pids+=($!)
  names+=("$t")
done
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then status[${names[$i]}]=ok; else status[${names[$i]}]=FAILED; fi
done

printf '[fuzz] %-24s %10s %8s %6s %7s  %s\n' target execs exec/s cov corpus result
for t in "${TARGETS[@]}"; do
  log="$BUILD_DIR/logs/$t.log"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
  corp=$(grep -oE 'corp: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
  printf '[fuzz] %-24s %10s %8s %6s %7s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${corp:-?}" "${status[$t]}"
  if [[ "${status[$t]}" != ok ]]; then
    failed+=("$t")
    grep -E "unexpected exception|fuzz check failed|ERROR: (AddressSanitizer|libFuzzer|LeakSanitizer)|runtime error|SUMMARY" "$log" | head -4 >&2 || true
    artifact=$(sed -n 's/.*Test unit written to //p' "$log" | tail -1)
    echo "[fuzz]   reproduce: $BUILD_DIR/${t}_fuzz ${artifact:-<see $log>}" >&2
    echo "[fuzz]   once fixed, keep it: cp ${artifact:-<input>} tests/fuzz/regressions/$t/" >&2
    # The input itself where it is small, so that a log from another machine (CI) reproduces it.
    if [[ -n "$artifact" && -f "$artifact" ]] && (($(stat -c %s "$artifact") <= 16384)); then
      echo "[fuzz]   the input ($(stat -c %s "$artifact") bytes; recreate it: echo <the line below> | base64 -d > input):" >&2
      base64 -w 0 "$artifact" >&2
      echo >&2
    fi
  fi
done
((${#failed[@]} == 0)) || { echo "[fuzz] FAILED: ${failed[*]}" >&2; exit 1; }
echo "[fuzz] no crashes"

#!/usr/bin/env bash
# Builds titan and the unit tests with AddressSanitizer + UndefinedBehaviorSanitizer (g++) into
# build-asan/ and runs the unit tests through ctest. LibTorch itself is not instrumented. A long run
# (a full build of ~20 min on 2 cores, then the tests), not part of ./run_tests.sh.
#
#   scripts/sanitize.sh                        every unit test
#   scripts/sanitize.sh -R 'Config|Tokenizer'  a subset (arguments go to ctest)
#   scripts/sanitize.sh --build-only
#
# Any sanitizer report fails its test. Suppressions, each justified: tests/sanitize/*.supp.
# docs/fuzzing.md records the last full run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${ASAN_BUILD_DIR:-$ROOT/build-asan}"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || { echo "[sanitize] ERROR: $ROOT/.venv is missing: run scripts/setup.sh first" >&2; exit 1; }
BUILD_ONLY=0
if [[ "${1:-}" == --build-only ]]; then BUILD_ONLY=1; shift; fi

export PATH="$ROOT/.venv/bin:$PATH"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
if [[ -d /usr/local/cuda/bin ]]; then export PATH="$PATH:/usr/local/cuda/bin"; fi
# -g1: file:line in reports at little cost (the main CMakeLists sets -O2 for RelWithDebInfo).
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -g1"
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" \
    -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
fi
start=$(date +%s)
cmake --build "$BUILD_DIR" --target titan titan_tests
echo "[sanitize] build: $(($(date +%s) - start)) s"
((BUILD_ONLY)) && exit 0

SUPP="$ROOT/tests/sanitize"
# The first report fails the process; worker processes (multi-process tests) inherit these.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=0}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$SUPP/lsan.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-suppressions=$SUPP/ubsan.supp:print_stacktrace=1:halt_on_error=1}"
cd "$BUILD_DIR"
start=$(date +%s)
ctest --output-on-failure --timeout 2400 -j "$(nproc)" "$@"
echo "[sanitize] tests: $(($(date +%s) - start)) s"

#!/usr/bin/env bash
# README command 2: installs what is missing, builds, and runs every test.
#   ./run_tests.sh                  all tests, then a short fuzzing run of every parser (scripts/fuzz.sh)
#   ./run_tests.sh -R Llama3Parity  a subset (arguments go to ctest; no fuzzing)
# Environment: TITAN_FUZZ_SECONDS per fuzz target (default 20), 0 to skip the fuzzing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh"
cd "$ROOT/build"
status=0
ctest --output-on-failure --timeout 900 -j "$(nproc)" "$@" || status=$?
FUZZ_SECONDS="${TITAN_FUZZ_SECONDS:-20}"
if (($# == 0)) && [[ "$FUZZ_SECONDS" != 0 ]]; then
  "$ROOT/scripts/fuzz.sh" --seconds "$FUZZ_SECONDS" || status=1
fi
exit "$status"

#!/usr/bin/env bash
# README command 2: installs what is missing, builds, and runs every test.
#   ./run_tests.sh                  all tests
#   ./run_tests.sh -R Llama3Parity  a subset (arguments go to ctest)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh"
cd "$ROOT/build"
ctest --output-on-failure --timeout 900 -j "$(nproc)" "$@"

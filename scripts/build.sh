#!/usr/bin/env bash
# Configures (once) and builds titan into build/ with the project's Python environment's libtorch.
# Usage: scripts/build.sh [ninja targets...]   (env BUILD_DIR=build, BUILD_TYPE=RelWithDebInfo)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || { echo "[build] ERROR: $ROOT/.venv is missing: run scripts/setup.sh first" >&2; exit 1; }
export PATH="$ROOT/.venv/bin:$PATH"   # the venv's CMake (new enough for CUDA 13) comes first
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}"  # relative paths: clones share cache entries
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
if [[ -d /usr/local/cuda/bin ]]; then export PATH="$PATH:/usr/local/cuda/bin"; fi
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  # torch==2.11.0 from PyPI is a CUDA build, and its CMake configuration needs the CUDA toolkit even to
  # build the CPU paths.
  if [[ "$("$PY" -c 'import torch; print(torch.version.cuda or "")')" != "" ]] && ! command -v nvcc >/dev/null; then
    echo "[build] ERROR: the libtorch in .venv is a CUDA build and its CMake config needs the CUDA toolkit," >&2
    echo "[build]        but nvcc is not on PATH or in /usr/local/cuda/bin: install the CUDA 13 toolkit." >&2
    exit 1
  fi
  PREFIX=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
    -DCMAKE_PREFIX_PATH="$PREFIX"
fi
cmake --build "$BUILD_DIR" -- "$@"

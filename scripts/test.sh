#!/usr/bin/env bash
# Set up (or reuse) .venv and run the test suite. Extra args go to pytest, e.g. `-m "not slow"`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# Build the native kernels of every engine this CPU runs once, up front (~1 min per build on a fresh machine;
# cached), rather than inside the first test or server stub that needs them; the engine tests compare them all.
"$VENV/bin/python" -c "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s')
from dspark_trt.runtime import native; native.available(); print('native engines here:', native.runnable_engines())" >&2
exec "$VENV/bin/python" -m pytest -q --timeout=600 --durations=30 "$@"

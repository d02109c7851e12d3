#!/usr/bin/env bash
# Start Triton on a built model repository (foreground; Ctrl-C / SIGTERM stops it cleanly).
# Usage: scripts/launch_triton.sh [build/NAME/model_repo] [extra `dspark-trt serve` flags, e.g. --http-port 9000]
# Uses the system `tritonserver` when present (NVIDIA container), else the one bundled in nvidia-pytriton;
# the environment the python-backend stub needs (PATH, LD_LIBRARY_PATH, backend dir) is set by dspark-trt serve.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO="${1:-$ROOT/build/default/model_repo}"
[[ $# -gt 0 ]] && shift
if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
exec "$PY" -m dspark_trt.cli serve --repo "$REPO" "$@"

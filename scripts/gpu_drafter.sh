#!/usr/bin/env bash
# On a GPU host (the lent H200): put the carried target GGUF back together, install the carried wheels, and run
# scripts/gpu_drafter.py (teacher pass on CUDA, the data → τ curve and the sweep, loop τ, packing) in ≤ 9 min.
# Carried (prepared by `bash scripts/gpu_drafter.sh --prepare`): .gpu/target.gguf.partNN + .gpu/target.gguf.sha256
# (the embedded SmolLM2-135M GGUF, split to fit two transfers) and .whl/gguf-*.whl (not in the GPU image).
# Usage: bash scripts/gpu_drafter.sh OUTDIR      DSPARK_GPU_DRAFTER_SMOKE=1 for a CPU run of the same script.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ "${1:-}" = "--prepare" ]; then  # here, before the device calls
  PY="${PYTHON:-.venv/bin/python}"
  G="$("$PY" -c 'from dspark_trt.runtime.default_model import find_default_gguf; print(find_default_gguf())')"
  mkdir -p .gpu .whl && rm -f .gpu/target.gguf.part*
  split -b 50000000 -d "$G" .gpu/target.gguf.part
  sha256sum "$G" | cut -d' ' -f1 > .gpu/target.gguf.sha256
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  ls -la .gpu .whl
  exit 0
fi
OUTD="${1:-$ROOT/gpu_drafter_out}"
mkdir -p "$OUTD"
PY="${PYTHON:-python3}"
WORK="${DSPARK_GPU_WORK:-/tmp/dspark_gpu_work}"
mkdir -p "$WORK"
cat .gpu/target.gguf.part* > "$WORK/target.gguf" || { echo "FAIL: no carried GGUF parts in .gpu/"; exit 2; }
if [ "$(sha256sum "$WORK/target.gguf" | cut -d' ' -f1)" != "$(cat .gpu/target.gguf.sha256)" ]; then
  echo "FAIL: the GGUF parts do not add up (a part missing from an earlier transfer?): $(ls .gpu)"; exit 2
fi
if ! "$PY" -c "import gguf" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" DSPARK_NATIVE=0 DSPARK_CACHE="$WORK/cache"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
(nvidia-smi || true) > "$WORK/nvidia-smi.txt" 2>&1
export TQDM_MININTERVAL=15  # keep the logs small: the tool returns 64 MiB at most
timeout "${DSPARK_GPU_DRAFTER_TIMEOUT:-540}" "$PY" scripts/gpu_drafter.py --gguf "$WORK/target.gguf" \
  --corpus data/chatgen/*.jsonl.gz --work "$WORK" --out "$OUTD" --deadline-s "${DSPARK_GPU_DRAFTER_DEADLINE:-500}" \
  2> >(tee "$OUTD/gpu_drafter.log" | grep -E "stage|\] |Error|error" >&2)

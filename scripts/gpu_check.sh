#!/usr/bin/env bash
# One GPU check of the dspark kernels + reference runtime; fits in 8 minutes on one H200.
# Usage: bash scripts/gpu_check.sh OUTDIR   (run from a copy of the repo; uses whatever python3 has torch+triton)
# Writes OUTDIR/report.md, OUTDIR/report.json (+ nvidia-smi.txt, gpu_check.log). Exit 1 on parity failure.
# DSPARK_GPU_CHECK_SMOKE=1 runs the same script on CPU (Triton interpreter, tiny shapes) to test the script.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/gpu_report}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/dspark_triton_cache}"   # keep compiled kernels out of OUT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ "${DSPARK_GPU_CHECK_SMOKE:-0}" = "1" ] || unset TRITON_INTERPRET
(nvidia-smi || echo "nvidia-smi not available") > "$OUT/nvidia-smi.txt" 2>&1
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') and u.find_spec('triton') else 1)" \
    2>"$OUT/import_error.txt"; then
  echo "FAIL: $PY cannot import torch and triton (see $OUT/import_error.txt)" | tee "$OUT/report.md"
  exit 1
fi
rm -f "$OUT/import_error.txt"
LIMIT=$(( ${DSPARK_GPU_CHECK_DEADLINE:-450} + 20 ))  # DSPARK_GPU_CHECK_DEADLINE: seconds for the sections
timeout $LIMIT "$PY" scripts/gpu_check.py "$OUT" 2> "$OUT/gpu_check.log"
rc=$?
if [ $rc -eq 124 ]; then
  echo "FAIL: gpu_check.py exceeded $LIMIT s (see $OUT/gpu_check.log)" | tee -a "$OUT/report.md"
fi
exit $rc

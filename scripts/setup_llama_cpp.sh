#!/usr/bin/env bash
# Peer for scripts/bench_runtime.py: build llama-cpp-python 0.3.36 from source into the project venv and write the
# embedded default target (SmolLM2-135M-Instruct) as BF16 and Q8_0 GGUFs with the sdist's own converter.
#
#   bash scripts/setup_llama_cpp.sh [OUT_DIR]      # default OUT_DIR: runs/gguf; ~6 min of both cores on 2 cores
#   .venv/bin/python scripts/bench_runtime.py --llama-gguf bf16=runs/gguf/smollm2-135m-bf16.gguf \
#       --llama-gguf q8_0=runs/gguf/smollm2-135m-q8_0.gguf
#
# AMX is off: on Sapphire Rapids KVM guests a -march=native build dies with SIGILL (`tilezero`) in ggml's AMX path
# on the first forward; AVX-512 (VNNI, BF16, VBMI) stays on. Idempotent: an importable llama_cpp and existing GGUFs
# are kept.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSPARK_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
OUT="$(mkdir -p "${1:-$ROOT/runs/gguf}" && cd "${1:-$ROOT/runs/gguf}" && pwd)"
VERSION=0.3.36
SDIST="$OUT/src/llama_cpp_python-$VERSION.tar.gz"
mkdir -p "$OUT/src"
[ -f "$SDIST" ] || "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$OUT/src"
if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
  echo "building llama-cpp-python $VERSION (AMX off; ~6 min on 2 cores)" >&2
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    "$PY" -m pip install -q "$SDIST"
fi
SRC="$OUT/src/llama_cpp_python-$VERSION"
[ -d "$SRC/vendor/llama.cpp/conversion" ] || tar -xzf "$SDIST" -C "$OUT/src" \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" "llama_cpp_python-$VERSION/vendor/llama.cpp/gguf-py" \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/conversion"
"$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q "sentencepiece>=0.2"
TARGET="$("$PY" -c "from dspark_trt.runtime.default_model import default_target_dir; print(default_target_dir())")"
for t in bf16 q8_0; do
  f="$OUT/smollm2-135m-$t.gguf"
  if [ ! -s "$f" ]; then
    # the converter runs on its own vendored gguf-py (the project pins another gguf for reading GGUF)
    PYTHONPATH="$SRC/vendor/llama.cpp/gguf-py" "$PY" "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$TARGET" \
      --outtype "$t" --outfile "$f" >"$OUT/convert-$t.log" 2>&1 || { tail -5 "$OUT/convert-$t.log" >&2; exit 1; }
  fi
  echo "$t=$f"
done

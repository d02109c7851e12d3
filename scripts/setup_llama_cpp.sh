#!/usr/bin/env bash
# Peer for scripts/bench_runtime.py: build llama-cpp-python 0.3.36 from source into the project venv and write the
# embedded default target (SmolLM2-135M-Instruct) as BF16 and Q8_0 GGUFs with the sdist's own converter.
#
#   bash scripts/setup_llama_cpp.sh [OUT_DIR]      # default OUT_DIR: runs/gguf; ~6 min of both cores on 2 cores
#   .venv/bin/python scripts/bench_runtime.py --llama-gguf bf16=runs/gguf/smollm2-135m-bf16.gguf \
#       --llama-gguf q8_0=runs/gguf/smollm2-135m-q8_0.gguf
#
# Built for the machine it runs on: on AVX-512 hosts AVX-512 (VNNI, BF16, VBMI) on and AMX off (on Sapphire Rapids
# KVM guests ggml's AMX path dies with SIGILL (`tilezero`) on the first forward); on hosts without AVX-512 with
# native flags (-DGGML_NATIVE=ON). LLAMA_ISA=avx2 builds an AVX2 + FMA only llama.cpp on any host (the peer of our
# forced avx2 engine on an AVX-512 machine). The build goes to OUT_DIR/llama-ISA (pip --target); bench_runtime.py
# finds it there (--llama-isa). Idempotent: an importable build and existing GGUFs are kept.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSPARK_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
OUT="$(mkdir -p "${1:-$ROOT/runs/gguf}" && cd "${1:-$ROOT/runs/gguf}" && pwd)"
VERSION=0.3.36
SDIST="$OUT/src/llama_cpp_python-$VERSION.tar.gz"
mkdir -p "$OUT/src"
[ -f "$SDIST" ] || "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$OUT/src"
ISA="${LLAMA_ISA:-auto}"
if [ "$ISA" = auto ]; then
  grep -qw avx512f /proc/cpuinfo && ISA=avx512 || ISA=native
fi
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }  # an extension of this CPU: ON / OFF
case "$ISA" in
  # each AVX-512 extension only where the CPU has it (Zen 4 has AVX512_VNNI / BF16 / VBMI but not the VEX AVX-VNNI of
  # Sapphire Rapids and Zen 5: built with it, ggml dies with SIGILL on the first forward)
  avx512) FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=$(has avx_vnni) \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni) \
-DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
  avx2) FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
  native) FLAGS="-DGGML_NATIVE=ON" ;;
  *) echo "LLAMA_ISA must be auto, avx512, avx2 or native (got $ISA)" >&2; exit 2 ;;
esac
LIB="$OUT/llama-$ISA"
# rebuilt when it does not import or was built with other flags (a copied build, or this script's flags changed)
if ! PYTHONPATH="$LIB" "$PY" -c "import llama_cpp" 2>/dev/null || [ "$(cat "$LIB/.cmake_args" 2>/dev/null)" != "$FLAGS" ]; then
  echo "building llama-cpp-python $VERSION for $ISA into $LIB (~6 min on 2 cores)" >&2
  rm -rf "$LIB"
  CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    "$PY" -m pip install -q --no-deps --target "$LIB" "$SDIST"
  "$PY" -m pip install -q diskcache jinja2 typing-extensions  # its dependencies, in the venv (numpy<2 stays)
  echo "$FLAGS" > "$LIB/.cmake_args"
fi
echo "llama_cpp=$LIB"
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

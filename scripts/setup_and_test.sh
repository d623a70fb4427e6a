#!/usr/bin/env bash
# The README's test command: set up (.venv), then run the test-suite (CUDA tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -ra tests

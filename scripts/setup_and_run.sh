#!/usr/bin/env bash
# The README's main-job command: set up (.venv), then answer a batch of chat prompts with the embedded SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m apex_compile "$@"

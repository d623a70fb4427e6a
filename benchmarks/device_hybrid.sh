#!/usr/bin/env bash
# One GPU-machine call for hybrid decoding: the CUDA end-to-end tests, then e2e_hybrid (logs, JSON under $OUT).
# Usage (device tool, repo root): TESTS=... HYBRID_ARGS=... bash benchmarks/device_hybrid.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit APEX_COMPILE_CACHE_DIR=/tmp/apex_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import apex_compile" 2>&1 | tail -2
if [ -n "${TESTS-tests/e2e/test_e2e_cuda.py}" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -m cuda --tb=short ${TESTS:-tests/e2e/test_e2e_cuda.py} \
    > "$OUT/cuda_tests.log" 2>&1; tail -${TEST_TAIL:-4} "$OUT/cuda_tests.log"
fi
pkill -f torch/_inductor/compile_worker 2>/dev/null
timeout ${HYBRID_TIMEOUT:-420} python3 benchmarks/e2e_hybrid.py --out "$OUT/e2e_hybrid.json" ${HYBRID_ARGS:-} \
  > "$OUT/e2e_hybrid.log" 2>&1
grep -v "^\s*$" "$OUT/e2e_hybrid.log" | grep -v "capturing CUDA" | tail -${TAIL:-40}

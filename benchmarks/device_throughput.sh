#!/usr/bin/env bash
# One GPU-machine call: system CUDA tests, then the decode-throughput benchmark (logs and JSON under $OUT).
# Usage (device tool, repo root): TESTS=... E2E_ARGS=... bash benchmarks/device_throughput.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import apex_compile" 2>&1 | tail -2
if [ -n "${TESTS-tests/test_e2e_cuda.py}" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -m cuda --tb=short ${TESTS:-tests/test_e2e_cuda.py} \
    > "$OUT/cuda_tests.log" 2>&1; tail -25 "$OUT/cuda_tests.log"
fi
pkill -f torch/_inductor/compile_worker 2>/dev/null
timeout ${E2E_TIMEOUT:-330} python3 benchmarks/e2e_throughput.py --out "$OUT/e2e_throughput.json" ${E2E_ARGS:-} \
  2>&1 | tee "$OUT/e2e_throughput.log" | grep -v "^\s*$" | tail -40

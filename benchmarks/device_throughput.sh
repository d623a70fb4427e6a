#!/usr/bin/env bash
# One GPU-machine call: system CUDA tests, the engine's warm-up in two fresh processes (cold, then warm compile
# cache), then the decode-throughput benchmark (logs and JSON under $OUT).
# Usage (device tool, repo root): TESTS=... WARMUP=0 E2E_ARGS=... bash benchmarks/device_throughput.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit APEX_COMPILE_CACHE_DIR=/tmp/apex_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import apex_compile" 2>&1 | tail -2
if [ -n "${TESTS-tests/e2e/test_e2e_cuda.py}" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -m cuda --tb=short ${TESTS:-tests/e2e/test_e2e_cuda.py} \
    > "$OUT/cuda_tests.log" 2>&1; tail -4 "$OUT/cuda_tests.log"
fi
if [ "${WARMUP:-1}" = 1 ]; then
  for run in cold warm; do
    timeout 200 python3 benchmarks/e2e_throughput.py --warmup-only --shapes ${WARMUP_SHAPE:-llama3_8b} --batches 64 \
      2>&1 | grep -E "^warm-up|Error" | sed "s/^/$run: /"
  done
fi
pkill -f torch/_inductor/compile_worker 2>/dev/null
TORCH_LOGS=recompiles timeout ${E2E_TIMEOUT:-330} python3 benchmarks/e2e_throughput.py --out "$OUT/e2e_throughput.json" \
  ${E2E_ARGS:-} > "$OUT/e2e_throughput.log" 2>&1
grep -v "^\s*$" "$OUT/e2e_throughput.log" | grep -v "capturing CUDA" | tail -${TAIL:-45}

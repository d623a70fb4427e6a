#!/usr/bin/env bash
# One GPU-machine call for the system: CUDA tests with full tracebacks, then the end-to-end GPU benchmark.
# Usage (device tool, repo root): bash benchmarks/device_e2e.sh   (logs and JSON under $OUT)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import apex_compile, apex_compile.ops as o; print('cpu isa', o.cpu_isa())" 2>&1 | tail -2
# The kernel CUDA tests are in device_kernels.sh ("tests"); these are the system-level ones.
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m cuda --tb=short ${TESTS:-tests/e2e/test_backend.py tests/e2e/test_e2e_cuda.py} \
  > "$OUT/cuda_tests.log" 2>&1; grep -E "passed|failed" "$OUT/cuda_tests.log" | tail -3
pkill -f torch/_inductor/compile_worker 2>/dev/null
timeout ${E2E_TIMEOUT:-300} python3 benchmarks/e2e_gpu.py --out "$OUT/e2e_gpu.json" ${E2E_ARGS:-} > "$OUT/e2e_gpu.log" 2>&1; tail -40 "$OUT/e2e_gpu.log"

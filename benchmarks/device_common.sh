# Sourced by the device_*.sh scripts: environment, the C++ build, then the CUDA tests named by TESTS (default
# tests/e2e/test_e2e_cuda.py; TESTS="" skips them; TESTS_K: a pytest -k expression, spaces allowed), their log's
# last TEST_TAIL lines printed.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit APEX_COMPILE_CACHE_DIR=/tmp/apex_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import apex_compile" 2>&1 | tail -2
if [ -n "${TESTS-tests/e2e/test_e2e_cuda.py}" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -m cuda --tb=short ${TESTS_K:+-k "$TESTS_K"} \
    ${TESTS:-tests/e2e/test_e2e_cuda.py} \
    > "$OUT/cuda_tests.log" 2>&1; tail -${TEST_TAIL:-4} "$OUT/cuda_tests.log"
fi

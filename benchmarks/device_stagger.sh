#!/usr/bin/env bash
# One GPU-machine call that separates a staggered decode step's costs: stagger_profile.py at full shape, one
# child process per mode (GPU time of each graph alone, host time per step, the step with the CPU job dropped;
# TRACE=N adds a profiler trace of N steps per mode), then the staggered step again with each worker thread count
# in MORE_THREADS. The CUDA tests named by TESTS first (none by default). Logs, JSON under $OUT.
# Usage (device tool, repo root): TESTS="tests/e2e/test_e2e_cuda.py::test_staggered_equals_hf_generate_fp32" \
#   TRACE=3 bash benchmarks/device_stagger.sh   (cold machine, 32 layers: ~200 + 150 + 75 s for the three modes)
TESTS=${TESTS-}
source "$(dirname "$0")/device_common.sh"
timeout ${PROFILE_TIMEOUT:-450} python3 benchmarks/stagger_profile.py --layers ${LAYERS:-32} --trace ${TRACE:-0} \
  --modes ${MODES:-staggered,staggered-no-job,never} --host-gib ${HOST_GIB:-32} \
  --out "$OUT/stagger_profile.json" > "$OUT/stagger_profile.log" 2>&1
grep -aE "^ *(never|staggered)" "$OUT/stagger_profile.log" | cut -c1-1200
for threads in ${MORE_THREADS:-}; do
  timeout ${MORE_TIMEOUT:-150} python3 benchmarks/stagger_profile.py --layers ${LAYERS:-32} --modes staggered \
    --cpu-threads "$threads" --host-gib ${HOST_GIB:-32} --out "$OUT/stagger_profile_t$threads.json" \
    > "$OUT/stagger_profile_t$threads.log" 2>&1
  echo "--- cpu threads $threads"; grep -aE "^staggered" "$OUT/stagger_profile_t$threads.log" | cut -c1-600
done

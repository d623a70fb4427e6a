#!/usr/bin/env bash
# One GPU-machine call that separates a staggered decode step's costs (notes item 26): the CPU job alone and
# the launching thread's slowdown beside it (cpu_job.py), then stagger_profile.py at full shape (GPU time of
# each graph alone, host time per step, the step with the CPU job dropped), then the staggered step again with
# each worker thread count in MORE_THREADS; TRACE=N adds a profiler trace of N steps per mode. CUDA tests only
# when TESTS is given. Logs and JSON under $OUT.
# Usage (device tool, repo root): MORE_THREADS="8" bash benchmarks/device_stagger.sh
TESTS=${TESTS-}
source "$(dirname "$0")/device_common.sh"
timeout ${JOB_TIMEOUT:-90} python3 benchmarks/cpu_job.py --out "$OUT/cpu_job.json" > "$OUT/cpu_job.log" 2>&1
grep -v "^\s*$" "$OUT/cpu_job.log" | tail -20
timeout ${PROFILE_TIMEOUT:-330} python3 benchmarks/stagger_profile.py --layers ${LAYERS:-32} --trace ${TRACE:-0} \
  --out "$OUT/stagger_profile.json" > "$OUT/stagger_profile.log" 2>&1
grep -E "^ *(never|staggered)" "$OUT/stagger_profile.log"
for threads in ${MORE_THREADS:-}; do
  timeout ${MORE_TIMEOUT:-150} python3 benchmarks/stagger_profile.py --layers ${LAYERS:-32} --modes staggered \
    --cpu-threads "$threads" --out "$OUT/stagger_profile_t$threads.json" > "$OUT/stagger_profile_t$threads.log" 2>&1
  echo "--- cpu threads $threads"; grep -E "^staggered" "$OUT/stagger_profile_t$threads.log"
done

#!/usr/bin/env bash
# One GPU-machine call that separates a staggered decode step's costs (notes item 26): the CPU job alone
# (cpu_job.py), then stagger_profile.py at full shape for each worker thread count in THREADS (GPU time of each
# graph alone, host time per step, the step with the CPU job dropped). Logs and JSON under $OUT.
# Usage (device tool, repo root): THREADS="15 8" TESTS="" bash benchmarks/device_stagger.sh
source "$(dirname "$0")/device_common.sh"
timeout ${JOB_TIMEOUT:-90} python3 benchmarks/cpu_job.py --out "$OUT/cpu_job.json" > "$OUT/cpu_job.log" 2>&1
grep -v "^\s*$" "$OUT/cpu_job.log" | tail -16
for threads in ${THREADS:-15 8}; do
  timeout ${PROFILE_TIMEOUT:-240} python3 benchmarks/stagger_profile.py --layers ${LAYERS:-32} --cpu-threads "$threads" \
    --out "$OUT/stagger_profile_t$threads.json" > "$OUT/stagger_profile_t$threads.log" 2>&1
  echo "--- cpu threads $threads"; grep -E "^(never|staggered)" "$OUT/stagger_profile_t$threads.log"
done

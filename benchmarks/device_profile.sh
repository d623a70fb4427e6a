#!/usr/bin/env bash
# One GPU-machine call: the CUDA tests named by TESTS (default none), then step_profile.py once per mode (logs
# under $OUT), e.g.
#   MODES="never auto" ARGS="--device-gib 2" bash benchmarks/device_profile.sh
TESTS=${TESTS-} source "$(dirname "$0")/device_common.sh"
for mode in ${MODES:-never auto}; do
  timeout ${PROFILE_TIMEOUT:-240} python3 benchmarks/step_profile.py --mode "$mode" --out-dir /tmp ${ARGS:-} \
    > "$OUT/profile_${mode//:/-}.log" 2>&1
  grep "^==" "$OUT/profile_${mode//:/-}.log"
done

#!/usr/bin/env bash
# One GPU-machine call: an A/B of the C++ CPU ops, this tree's against a baseline tree's (BASE: a directory holding
# apex_compile/, csrc/ and benchmarks/ of the commit before, e.g. from `git archive`), by cpu_probe_gap.py run
# alternately ROUNDS times (JSON and logs under $OUT), e.g.
#   BASE=ab_base ARGS="--pool-gib 16 --rounds 2" bash benchmarks/device_cpp_ab.sh
TESTS=${TESTS-} source "$(dirname "$0")/device_common.sh"
APEX_COMPILE_BUILD_DIR=/tmp/apex_jit_base python3 -c "import sys; sys.path.insert(0, '$BASE'); import apex_compile" \
  2>&1 | tail -1
for round in $(seq ${ROUNDS:-2}); do
  timeout ${AB_TIMEOUT:-200} python3 benchmarks/cpu_probe_gap.py ${ARGS:-} --out "$OUT/gap_new_$round.json" \
    > "$OUT/gap_new_$round.log" 2>&1
  APEX_COMPILE_BUILD_DIR=/tmp/apex_jit_base timeout ${AB_TIMEOUT:-200} python3 "$BASE/benchmarks/cpu_probe_gap.py" \
    ${ARGS:-} --out "$OUT/gap_base_$round.json" > "$OUT/gap_base_$round.log" 2>&1
  grep -H "GB/s" "$OUT/gap_new_$round.log" "$OUT/gap_base_$round.log" | sed "s|$OUT/||"
done

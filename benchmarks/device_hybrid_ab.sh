#!/usr/bin/env bash
# One GPU-machine call of same-machine A/Bs for hybrid decoding: e2e_hybrid once per variant (one process each,
# the compile cache shared), then a table of never / auto tokens/s per variant. Variants: "name:extra args" joined
# by ";". Usage (device tool, repo root):
#   VARIANTS="gate:;nogate:--no-job-gate;threads8:--cpu-threads 8" BASE="--device-gib 2" \
#     bash benchmarks/device_hybrid_ab.sh
TESTS="${TESTS-}"  # no CUDA tests unless asked for
source "$(dirname "$0")/device_common.sh"
BASE=${BASE:---device-gib 2}
IFS=';' read -ra RUNS <<< "${VARIANTS:-gate:;nogate:--no-job-gate}"
for run in "${RUNS[@]}"; do
  name=${run%%:*}; extra=${run#*:}
  pkill -f torch/_inductor/compile_worker 2>/dev/null
  timeout ${RUN_TIMEOUT:-200} python3 benchmarks/e2e_hybrid.py --shapes llama3_8b --modes never,auto --host-gib 32 \
    --hf-batch -1 --fill-steps 1500 $BASE $extra --out "$OUT/ab_$name.json" > "$OUT/ab_$name.log" 2>&1
  echo "== $name ($extra)"; grep -E "^llama|prefill steps|decode steps \(" "$OUT/ab_$name.log" | cut -c1-220
done

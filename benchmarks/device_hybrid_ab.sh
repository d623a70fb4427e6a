#!/usr/bin/env bash
# One GPU-machine call of same-machine A/Bs for hybrid decoding: device_hybrid.sh once per variant (one process
# each, never and auto, the compile cache shared). Variants: "name:extra e2e_hybrid args" joined by ";".
# Usage (device tool, repo root):
#   VARIANTS="base:;gate:--modes auto --job-gate;threads8:--modes auto --cpu-threads 8" BASE="--device-gib 2" \
#     bash benchmarks/device_hybrid_ab.sh
IFS=';' read -ra RUNS <<< "${VARIANTS:-base:;gate:--modes auto --job-gate}"
for run in "${RUNS[@]}"; do
  name=${run%%:*}
  echo "== $name (${run#*:})"
  TESTS="" NAME="ab_$name" HYBRID_TIMEOUT=${RUN_TIMEOUT:-300} TAIL=12 \
    HYBRID_ARGS="--shapes llama3_8b --modes never,auto --host-gib 32 --hf-batch -1 --fill-steps 1500 ${BASE:---device-gib 2} ${run#*:}" \
    bash "$(dirname "$0")/device_hybrid.sh"
done

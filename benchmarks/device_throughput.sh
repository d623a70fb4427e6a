#!/usr/bin/env bash
# One GPU-machine call: system CUDA tests, the engine's warm-up in two fresh processes (cold, then warm compile
# cache), then the decode-throughput benchmark (logs and JSON under $OUT).
# Usage (device tool, repo root): TESTS=... WARMUP=0 E2E_ARGS=... bash benchmarks/device_throughput.sh
source "$(dirname "$0")/device_common.sh"
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

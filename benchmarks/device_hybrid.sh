#!/usr/bin/env bash
# One GPU-machine call for hybrid decoding: the CUDA end-to-end tests, then e2e_hybrid (logs, JSON under $OUT).
# Usage (device tool, repo root): TESTS=... HYBRID_ARGS=... bash benchmarks/device_hybrid.sh
source "$(dirname "$0")/device_common.sh"
pkill -f torch/_inductor/compile_worker 2>/dev/null
timeout ${HYBRID_TIMEOUT:-420} python3 benchmarks/e2e_hybrid.py --out "$OUT/e2e_hybrid.json" ${HYBRID_ARGS:-} \
  > "$OUT/e2e_hybrid.log" 2>&1
grep -v "^\s*$" "$OUT/e2e_hybrid.log" | grep -v "capturing CUDA" | tail -${TAIL:-40}

#!/usr/bin/env bash
# One GPU-machine call for hybrid decoding: the CUDA end-to-end tests, then e2e_hybrid (logs, JSON under $OUT).
# Usage (device tool, repo root):
#   TESTS=... HYBRID_ARGS=... [NAME=e2e_hybrid] bash benchmarks/device_hybrid.sh
source "$(dirname "$0")/device_common.sh"
NAME=${NAME:-e2e_hybrid}
pkill -f torch/_inductor/compile_worker 2>/dev/null
timeout ${HYBRID_TIMEOUT:-420} python3 benchmarks/e2e_hybrid.py --out "$OUT/$NAME.json" ${HYBRID_ARGS:-} \
  > "$OUT/$NAME.log" 2>&1
grep -v "^\s*$" "$OUT/$NAME.log" | grep -v "capturing CUDA" | grep -v "warn" | tail -${TAIL:-40}

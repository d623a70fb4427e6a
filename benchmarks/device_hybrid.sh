#!/usr/bin/env bash
# One GPU-machine call for hybrid decoding: the CUDA end-to-end tests, then e2e_hybrid (logs, JSON under $OUT).
# Usage (device tool, repo root):
#   TESTS=... HYBRID_ARGS=... [NAME=e2e_hybrid] [POOL_PAGES=1] bash benchmarks/device_hybrid.sh
# POOL_PAGES=1 also runs benchmarks/host_pool_pages.py (the host pool's layouts; its output under $OUT).
source "$(dirname "$0")/device_common.sh"
NAME=${NAME:-e2e_hybrid}
pkill -f torch/_inductor/compile_worker 2>/dev/null
timeout ${HYBRID_TIMEOUT:-420} python3 benchmarks/e2e_hybrid.py --out "$OUT/$NAME.json" ${HYBRID_ARGS:-} \
  > "$OUT/$NAME.log" 2>&1
grep -v "^\s*$" "$OUT/$NAME.log" | grep -v "capturing CUDA" | grep -v "warn" | tail -${TAIL:-40}
if [ -n "${POOL_PAGES:-}" ]; then
  timeout ${POOL_PAGES_TIMEOUT:-120} python3 benchmarks/host_pool_pages.py --gib 1 --rounds 9 > "$OUT/host_pool_pages.txt" 2>&1
  tail -8 "$OUT/host_pool_pages.txt"
fi

#!/usr/bin/env bash
# One GPU-machine call: benchmarks/stagger_job.py on the host CPU (VARIANTS: name:env:args, ";"-separated;
# default: the engine's defaults only), logs and JSON under $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit APEX_COMPILE_CACHE_DIR=/tmp/apex_cache
python3 -c "import apex_compile" 2>&1 | tail -2
lscpu | grep -iE "model name|^CPU\(s\)|thread\(s\) per core|core\(s\) per socket|L3" | tr -s ' '
IFS=';' read -ra variants <<< "${VARIANTS:-default::}"
for v in "${variants[@]}"; do
  IFS=: read -r name env extra <<< "$v"
  timeout ${JOB_TIMEOUT:-120} env $env python3 benchmarks/stagger_job.py $extra --out "$OUT/job_$name.json" \
    > "$OUT/job_$name.log" 2>&1
  echo "== $name"; grep "^fit\|^rows [0-9]* \(flag\|flow\|multi\)" "$OUT/job_$name.log"
done

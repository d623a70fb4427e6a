#!/usr/bin/env bash
# One GPU-machine call for the kernels: JIT-build the C++ ops, run the CUDA tests, time the Triton kernels
# (and, with --cpu, the CPU attention op). Usage (device tool, repo root): bash benchmarks/device_kernels.sh [--cpu]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nproc; nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } 2>&1 | tee "$OUT/env.log"
python3 -c "import apex_compile, apex_compile.ops as o; print('cpu isa', o.cpu_isa())" 2>&1 | tee -a "$OUT/env.log"
timeout 240 python3 -m pytest -q -m cuda tests 2>&1 | tail -40 > "$OUT/cuda_tests.log"; tail -5 "$OUT/cuda_tests.log"
# A test run stopped by its time limit can leave inductor compile workers spinning: they would slow the CPU benchmark.
pkill -f torch/_inductor/compile_worker 2>/dev/null; sleep 2
if [ "${1:-}" = "--cpu" ]; then
  timeout 200 python3 benchmarks/cpu_attention.py --out "$OUT/cpu_attention.json" > "$OUT/cpu_attention.log" 2>&1; tail -3 "$OUT/cpu_attention.log"
fi
timeout 280 python3 benchmarks/triton_kernels.py --write-dispatch --out "$OUT/triton_kernels.json" > "$OUT/triton_kernels.log" 2>&1; tail -30 "$OUT/triton_kernels.log"
cp apex_compile/kernels/swiglu_dispatch.json "$OUT/" 2>/dev/null

#!/usr/bin/env bash
# One GPU-machine call for the kernels: JIT-build the C++ ops, run the CUDA tests, time CPU and Triton kernels.
# Usage (device tool, repo root): bash benchmarks/device_kernels.sh   (writes logs and JSON under $OUT)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nproc; nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } 2>&1 | tee "$OUT/env.log"
time python3 -c "import apex_compile, apex_compile.ops as o; print('cpu isa', o.cpu_isa())" 2>&1 | tee -a "$OUT/env.log"
timeout 200 python3 -m pytest -q -x -m cuda tests 2>&1 | tail -25 | tee "$OUT/cuda_tests.log"
timeout 200 python3 benchmarks/cpu_attention.py --out "$OUT/cpu_attention.json" 2>&1 | tee "$OUT/cpu_attention.log"
timeout 240 python3 benchmarks/triton_kernels.py --out "$OUT/triton_kernels.json" 2>&1 | tee "$OUT/triton_kernels.log"

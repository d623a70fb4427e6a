#!/usr/bin/env bash
# GPU-machine runs for the kernels. Usage (device tool, repo root): bash benchmarks/device_kernels.sh [PART ...]
# with PART among: cpu (CPU attention benchmark), cpu_sweep (its sweep of $CPU_SWEEP: split (default) or isa,
# extra arguments in $CPU_SWEEP_ARGS), triton (Triton benchmark, writes the swiglu dispatch table), triton_sweep
# (launch sweeps; sections from $SWEEP_SECTIONS, default all), tests (kernel CUDA tests, ~140 s); default:
# triton tests. One call holds at most 10 minutes: run "cpu tests" and "triton" as two calls. Logs and JSON go
# to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD APEX_COMPILE_BUILD_DIR=/tmp/apex_jit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${*:-triton tests}
{ nproc; nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } 2>&1 | tee "$OUT/env.log"
python3 -c "import apex_compile, apex_compile.ops as o; print('cpu isa', o.cpu_isa())" 2>&1 | tee -a "$OUT/env.log"
# The CPU benchmark runs first, before anything else has loaded the machine: any other core-hungry process
# (a compile worker, a test run) depresses it (cpu_attention.py reports the cores busy before it starts).
if [[ " $PARTS " == *" cpu "* ]]; then
  timeout 320 python3 benchmarks/cpu_attention.py --out "$OUT/cpu_attention.json" > "$OUT/cpu_attention.log" 2>&1
  tail -12 "$OUT/cpu_attention.log"
fi
if [[ " $PARTS " == *" cpu_sweep "* ]]; then
  timeout 300 python3 benchmarks/cpu_attention_sweep.py --sweep "${CPU_SWEEP:-split}" ${CPU_SWEEP_ARGS:-} \
    --out "$OUT/cpu_attention_sweep.json" > "$OUT/cpu_attention_sweep.log" 2>&1; tail -30 "$OUT/cpu_attention_sweep.log"
fi
if [[ " $PARTS " == *" triton "* ]]; then
  timeout 480 python3 benchmarks/triton_kernels.py --write-dispatch --out "$OUT/triton_kernels.json" \
    > "$OUT/triton_kernels.log" 2>&1; tail -30 "$OUT/triton_kernels.log"
  cp apex_compile/kernels/swiglu_dispatch.json "$OUT/" 2>/dev/null
fi
if [[ " $PARTS " == *" triton_sweep "* ]]; then
  timeout 400 python3 benchmarks/triton_sweep.py \
    --sections "${SWEEP_SECTIONS:-timing,rms_norm,rms_copy,rms_store,decode}" --out "$OUT/triton_sweep.json" \
    > "$OUT/triton_sweep.log" 2>&1; tail -40 "$OUT/triton_sweep.log"
fi
if [[ " $PARTS " == *" tests "* ]]; then  # the end-to-end CUDA tests are in device_e2e.sh
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_triton_rms_norm.py tests/kernels/test_triton_swiglu.py \
    tests/kernels/test_triton_attention.py 2>&1 | tail -40 > "$OUT/cuda_tests.log"
  tail -5 "$OUT/cuda_tests.log"
  # All CPU-op tests too: the GPU machine's torch differs from CI's (torch 2.11 once crashed on an error path).
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cpu_attention.py 2>&1 | tail -20 > "$OUT/cpu_tests.log"
  tail -2 "$OUT/cpu_tests.log"
  pkill -f torch/_inductor/compile_worker 2>/dev/null
fi

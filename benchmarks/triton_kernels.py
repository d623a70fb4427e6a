"""Benchmark of the Triton decoder-layer kernels against their torch baselines on one CUDA GPU (issue 3).

    python benchmarks/triton_kernels.py --out benchmarks/results/triton_kernels/<date>_<machine>.json --write-dispatch

Runs every kernel family in one process, in this order (`--sections` picks some), with one table, one targets
summary and one JSON file; each family is also a script of its own with the same options:
  triton_rms_norm.py  rms_norm   fused residual add + RMSNorm vs unfused torch ops
  triton_swiglu.py    silu_mul   silu(gate) * up vs F.silu(gate) * up
                      mlp        gate/up projections + SiLU-mul: torch eager vs cuBLAS paths vs the fused Triton
                                 GEMM; the swiglu dispatch table (--write-dispatch stores it)
  triton_decode.py    decode     paged_attention_gpu vs torch SDPA; block-size and launch-parameter sweeps
  triton_prefill.py   prefill    paged_prefill_attention_gpu over packed causal prompts vs SDPA per prompt
  triton_rope.py      rope       HF RoPE compiled by inductor vs eager, beside the QKV GEMM it would fuse into
Timing (CUDA-graph replay over rotating input sets; eager), rows, targets and the JSON fields:
benchmarks/kernel_bench.py.
"""
import triton_decode
import triton_prefill
import triton_rms_norm
import triton_rope
import triton_swiglu
from kernel_bench import main

FAMILIES = [triton_rms_norm, triton_swiglu, triton_decode, triton_prefill, triton_rope]
"""Kernel families in run order; their SECTIONS make the --sections choices."""

if __name__ == "__main__":
    main(FAMILIES, __doc__)

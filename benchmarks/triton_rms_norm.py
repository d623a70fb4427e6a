"""Benchmark of the Triton fused residual add + RMSNorm against unfused torch ops on one CUDA GPU.

    python benchmarks/triton_rms_norm.py --out rms_norm.json [--quick]

Section:
  rms_norm   fused residual add + RMSNorm, bf16, hidden 2048/4096/8192, tokens 1..16384, vs unfused torch ops;
             from 4096 tokens (the target rows) beside a copy of the same bytes in the kernel's shape and torch's
             copy_ of as many bytes, and, where the kernel uses PDL, a row without it.
Timing and the command line: benchmarks/kernel_bench.py. triton_kernels.py runs this with the other families.
"""
import sys

import torch
import triton
import triton.language as tl

# kernel_bench first: it puts the repository root on sys.path for the apex_compile imports.
from kernel_bench import DEVICE, DTYPE, Timing, check_close, interleaved_medians, main

from apex_compile.kernels._common import pdl_available
from apex_compile.kernels.rms_norm import rms_norm_launch, rms_norm_num_warps
from apex_compile.ops import rms_norm

SECTIONS = ("rms_norm",)
EPS = 1e-6
RMS_HIDDEN = [2048, 4096, 8192]
RMS_TOKENS = {"full": [1, 16, 256, 4096, 16384], "quick": [1, 256, 4096, 16384]}


def torch_rms_norm(x, weight, residual):
    hidden = x + residual
    hidden_f32 = hidden.float()
    variance = hidden_f32.pow(2).mean(-1, keepdim=True)
    return weight * (hidden_f32 * torch.rsqrt(variance + EPS)).to(hidden.dtype), hidden


def rms_norm_sets(bench, hidden, tokens):
    """Rotating (x, residual, weight, y, residual_out) sets for rms_norm and the bytes one call moves. Each set
    has its own outputs: outputs allocated inside a CUDA graph would reuse one address, and up to ~35 MB of
    writes could then stay in L2 instead of reaching HBM."""
    bytes_moved = 4 * tokens * hidden * 2 + hidden * 2
    sets = [(torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE),
             torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE),
             torch.randn(hidden, dtype=DTYPE, device=DEVICE),
             torch.empty(tokens, hidden, dtype=DTYPE, device=DEVICE),
             torch.empty(tokens, hidden, dtype=DTYPE, device=DEVICE))
            for _ in range(bench.rotation(bytes_moved))]
    return sets, bytes_moved


def rms_calls(sets, num_warps=None, pdl=None):
    """One rms_norm_launch per rms_norm input set, writing the set's own outputs."""
    return [lambda s=s: rms_norm_launch(s[0], s[2], EPS, s[1], s[3], s[4], num_warps=num_warps, pdl=pdl)
            for s in sets]


@triton.jit
def copy_rows_kernel(x_ptr, r_ptr, y_ptr, r_out_ptr, hidden, BLOCK_H: tl.constexpr):
    """The loads and stores of the rms_norm single-pass kernel (one contiguous row per program, the same eviction
    and store policies) without its math: x -> y, residual -> residual_out. Its time is the speed of light of
    rms_norm's traffic in this kernel shape."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    r = tl.load(r_ptr + row * hidden + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    tl.store(r_out_ptr + row * hidden + cols, r, mask=mask, cache_modifier=".cs")
    tl.store(y_ptr + row * hidden + cols, x, mask=mask, cache_modifier=".cs")


def copy_rows_calls(sets, hidden, tokens, num_warps=None):
    """One copy_rows_kernel launch per rms_norm input set (x -> y, residual -> residual_out), with the rms_norm
    kernel's num_warps unless given."""
    block_h = triton.next_power_of_2(hidden)
    num_warps = num_warps or rms_norm_num_warps(block_h)
    return [lambda s=s: copy_rows_kernel[(tokens,)](s[0], s[1], s[3], s[4], hidden, BLOCK_H=block_h,
                                                    num_warps=num_warps) for s in sets]


def memcpy_calls(sets):
    """Per rms_norm input set, torch's copy_ of as many bytes as the set's rms_norm call moves (one contiguous
    buffer of 2 rows per token into another): the same traffic in the CUDA memcpy's kernel shape."""
    sources = [torch.randn(2 * s[0].shape[0], s[0].shape[1], dtype=s[0].dtype, device=s[0].device) for s in sets]
    targets = [torch.empty_like(source) for source in sources]
    return [lambda source=source, target=target: target.copy_(source) for source, target in zip(sources, targets)]


def bench_rms_norm(bench, grid):
    """rms_norm rows; from 4096 tokens (the target rows) the kernel is timed in rounds of turns with two copies of
    its bytes, each reported as its own row: in the same kernel shape (the speed of light of that shape) and by
    torch's copy_ (the CUDA memcpy kernel, one buffer into another). Where the kernel uses programmatic
    dependent launch, a row without it shows what PDL contributes."""
    with_pdl = pdl_available(torch.device(DEVICE))
    for hidden in RMS_HIDDEN:
        for tokens in RMS_TOKENS[grid]:
            name = f"H={hidden} tokens={tokens} +residual"

            def row(hidden=hidden, tokens=tokens, name=name):
                sets, bytes_moved = rms_norm_sets(bench, hidden, tokens)
                x, residual, weight = sets[0][:3]
                y, residual_out = rms_norm(x, weight, EPS, residual)
                ref_y, ref_hidden = torch_rms_norm(x, weight, residual)
                check_close("rms_norm y", y, ref_y)
                check_close("rms_norm residual_out", residual_out, ref_hidden)
                residual_exact = torch.equal(residual_out, ref_hidden)
                # GPU time: the kernel writing each set's own outputs; eager time: the apex::rms_norm op call.
                graphs = {"kernel": bench.capture(rms_calls(sets))}
                if with_pdl:
                    graphs["no_pdl"] = bench.capture(rms_calls(sets, pdl=False))
                if tokens >= 4096:
                    copy_calls = copy_rows_calls(sets, hidden, tokens)
                    copy_calls[0]()
                    torch.testing.assert_close(sets[0][3], sets[0][0], rtol=0, atol=0)
                    graphs["copy"] = bench.capture(copy_calls)
                    graphs["memcpy"] = bench.capture(memcpy_calls(sets))
                timed = interleaved_medians(graphs, len(sets))
                eager_ms = bench.eager_ms([lambda s=s: rms_norm(s[0], s[2], EPS, s[1]) for s in sets])
                base = bench.measure([lambda s=s: torch_rms_norm(s[0], s[2], s[1]) for s in sets])

                def target(r):
                    return ">=85%HBM >=1.5x", r["pct_hbm"] >= 85 and r["speedup"] >= 1.5

                bench.add("rms_norm", name, Timing(timed["kernel"], eager_ms), base, bytes_moved=bytes_moved,
                          target=target if tokens >= 4096 else None, residual_out_bitwise_equal=residual_exact,
                          pdl=with_pdl)
                if with_pdl:
                    bench.add("rms_norm", f"H={hidden} tokens={tokens} kernel without PDL", Timing(timed["no_pdl"]),
                              base, bytes_moved=bytes_moved, pdl=False)
                if tokens >= 4096:
                    bench.add("rms_norm", f"H={hidden} tokens={tokens} copy of the same bytes",
                              Timing(timed["copy"]), base, bytes_moved=bytes_moved, speed_of_light_for=name)
                    bench.add("rms_norm", f"H={hidden} tokens={tokens} torch copy_ of as many bytes",
                              Timing(timed["memcpy"]), base, bytes_moved=bytes_moved, speed_of_light_for=name)

            bench.guard("rms_norm", name, row)


def run(bench, sections, grid, args):
    """The chosen sections of this family (see kernel_bench's family protocol)."""
    if "rms_norm" in sections:
        bench_rms_norm(bench, grid)
    return {}


if __name__ == "__main__":
    main([sys.modules[__name__]], __doc__)

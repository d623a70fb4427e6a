"""Triton kernel of the fused residual add + RMSNorm with HuggingFace LlamaRMSNorm numerics (launched by the op
`apex::rms_norm`, defined in apex_compile.ops.norm):

    residual_out = x + residual            (in x's dtype; a copy of x when no residual is given)
    y = weight * (residual_out_fp32 * rsqrt(mean(residual_out_fp32 ** 2) + eps)).to(x.dtype)

The product with the weight follows torch type promotion (bf16 x and bf16 weight give bf16; an fp32 weight
gives fp32), exactly like `LlamaRMSNorm.forward`.

Kernel: one program per row; inputs are loaded and outputs stored as streaming data (evict-first loads, ".cs"
stores: a decode step's next GEMM reads at most a few MB of them). Rows up to
`MAX_SINGLE_PASS_HIDDEN` elements are held in registers (one read of x and residual, one write of y and
residual_out); wider rows take a two-pass loop that re-reads the inputs.

On Hopper and newer GPUs the kernel is launched with programmatic dependent launch (PDL): each program first
releases its dependents (`gdc_launch_dependents`) and then waits for its predecessors (`gdc_wait`) before
touching memory, so consecutive launches overlap their start-up.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from apex_compile.kernels._common import check_float_dtype, check_same_device, next_pow2, pdl_available

MAX_SINGLE_PASS_HIDDEN = 16384
LOOP_BLOCK = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, residual_out_ptr,
    hidden, stride_x, stride_residual, stride_y, stride_residual_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, SINGLE_PASS: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # no memory access before gdc_wait: the predecessor may still write x or read y's memory
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    residual_row = residual_ptr + row * stride_residual
    y_row = y_ptr + row * stride_y
    residual_out_row = residual_out_ptr + row * stride_residual_out
    cols = tl.arange(0, BLOCK_H)
    if SINGLE_PASS:
        mask = cols < hidden
        # Every load is issued up front; the weight's latency then hides behind the row's.
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        h = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        if HAS_RESIDUAL:
            r = tl.load(residual_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
            h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_row + cols, h, mask=mask, cache_modifier=".cs")
        h_f32 = h.to(tl.float32)
        variance = tl.sum(h_f32 * h_f32, axis=0) / hidden
        rstd = tl.rsqrt(variance + eps)
        normed = (h_f32 * rstd).to(x_ptr.dtype.element_ty)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")
    else:
        sum_sq = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            c = start + cols
            mask = c < hidden
            h = tl.load(x_row + c, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(residual_row + c, mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(residual_out_row + c, h, mask=mask)
            h_f32 = h.to(tl.float32)
            sum_sq += h_f32 * h_f32
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK_H):
            c = start + cols
            mask = c < hidden
            h = tl.load(x_row + c, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(residual_row + c, mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            w = tl.load(weight_ptr + c, mask=mask, other=0.0)
            normed = (h.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
            y = w.to(tl.float32) * normed.to(tl.float32)
            tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=mask)


def check_rms_norm_inputs(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    """Raises a readable error unless x [..., H], weight [H] and residual (x's shape and dtype) fit."""
    check_float_dtype("rms_norm x", x)
    check_float_dtype("rms_norm weight", weight)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
            )
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)


def rms_norm_num_warps(block_h: int) -> int:
    """Warps of the single-pass kernel for rows of `block_h` (a power of two) elements: 2 for 2048-8192
    (32-128 elements per thread), otherwise one warp per 512 elements (at most 16); chosen by
    benchmarks/triton_sweep.py."""
    if 2048 <= block_h <= 8192:
        return 2
    return max(1, min(16, block_h // 512))


def rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                    y: torch.Tensor, residual_out: torch.Tensor, num_warps: Optional[int] = None,
                    pdl: Optional[bool] = None) -> None:
    """Runs the Triton kernel writing into preallocated contiguous `y` and `residual_out` (x's shape);
    `num_warps` overrides `rms_norm_num_warps`, `pdl=False` turns programmatic dependent launch off where it is
    available (benchmark sweeps)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    weight = weight.contiguous()
    y2 = y.view(-1, hidden)
    residual_out2 = residual_out.view(-1, hidden)
    rows = x2.shape[0]
    if rows == 0:
        return
    single_pass = hidden <= MAX_SINGLE_PASS_HIDDEN
    block_h = next_pow2(hidden) if single_pass else LOOP_BLOCK
    num_warps = num_warps or (rms_norm_num_warps(block_h) if single_pass else block_h // 512)
    use_pdl = pdl_available(x.device) and pdl is not False
    _rms_norm_kernel[(rows,)](
        x2, r2 if r2 is not None else x2, weight, y2, residual_out2,
        hidden, x2.stride(0), r2.stride(0) if r2 is not None else 0, y2.stride(0), residual_out2.stride(0),
        float(eps),
        HAS_RESIDUAL=r2 is not None, BLOCK_H=block_h, SINGLE_PASS=single_pass, USE_PDL=use_pdl,
        num_warps=num_warps, launch_pdl=use_pdl,
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks the inputs, allocates `(y, residual_out)` and runs the Triton kernel."""
    check_rms_norm_inputs(x, weight, residual)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rms_norm_launch(x, weight, eps, residual, y, residual_out)
    return y, residual_out

"""Triton kernel of the staggered plan's residual swap (apex_compile.runtime.stagger): at a layer's residual
add the block's first `width` rows leave (their residual is stored for the lane's next turn) and the stored
rows of the requests arriving come back:

    out = [store; src[width:]]      store = src[:width]      (one kernel; torch needs a splice and a copy)

One program per (row, column block): a block row reads its stored value before overwriting it, so the swap is
race-free within one launch.
"""
import torch
import triton
import triton.language as tl

from apex_compile.kernels._common import check_same_device, next_pow2

MAX_BLOCK = 4096


@triton.jit
def _swap_rows_kernel(src_ptr, store_ptr, out_ptr, cols, width, stride_src, stride_store, stride_out,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < cols
    value = tl.load(src_ptr + row * stride_src + offsets, mask=mask)
    if row < width:
        kept = tl.load(store_ptr + row * stride_store + offsets, mask=mask)
        tl.store(store_ptr + row * stride_store + offsets, value, mask=mask)
        tl.store(out_ptr + row * stride_out + offsets, kept, mask=mask)
    else:
        tl.store(out_ptr + row * stride_out + offsets, value, mask=mask)


def swap_rows(src: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    """Returns [store; src[width:]] and writes src[:width] into `store` (src [n, H], store [width, H], width
    <= n, one dtype and device, unit stride along H)."""
    check_same_device(src=src, store=store)
    if src.dim() != 2 or store.dim() != 2 or src.shape[1] != store.shape[1] or store.shape[0] > src.shape[0]:
        raise ValueError(f"swap_rows: src [n, H] and store [width <= n, H], got {tuple(src.shape)} and "
                         f"{tuple(store.shape)}")
    if src.dtype != store.dtype:
        raise TypeError(f"swap_rows: src and store dtypes differ ({src.dtype}, {store.dtype})")
    if src.stride(1) != 1 or store.stride(1) != 1:
        raise ValueError("swap_rows: rows must have unit stride")
    rows, cols = src.shape
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    if rows == 0 or cols == 0:
        return out
    block = min(next_pow2(cols), MAX_BLOCK)
    _swap_rows_kernel[(rows, triton.cdiv(cols, block))](
        src, store, out, cols, store.shape[0], src.stride(0), store.stride(0), out.stride(0), BLOCK=block,
        num_warps=4)
    return out

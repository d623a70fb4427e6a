"""Triton GEMM of decode-sized linears: y = x @ w.T for few rows (M <= MAX_ROWS), every weight tile read once.

At decode a linear layer is its weight read. One program owns a BLOCK_N slice of the output columns (and, with
SPLIT_K > 1, a 1/SPLIT_K slice of K): it streams its weight tiles once and multiplies them by all M rows of x
(one BLOCK_M tile of 16 or 32 rows, held in registers / L2), so the cost stays that of the weight read at any
M up to 32, where cuBLAS changes algorithm above 16 rows. Split-K programs write fp32 partial sums that one
small kernel adds and rounds (cuBLAS also accumulates in fp32 and rounds once).

The choice between this kernel and cuBLAS, and its config, comes per shape and row count from
`skinny_linear_dispatch.json` (written by `benchmarks/gemm_rows.py --write-dispatch` on the GPU it describes);
anything it does not cover takes F.linear.
"""
import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from apex_compile.kernels._common import (UPCAST_DOT_OPERANDS, cdiv, check_same_device, cuda_device_name, dot_precision,
                                          read_table)

MAX_ROWS = 32
SHARED_MEMORY_BUDGET = 160 * 1024
DISPATCH_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "skinny_linear_dispatch.json")


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, M, N, K, K_PER_SPLIT,
    stride_x, stride_w, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k + k0 < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # fp32 partial sums [SPLIT_K, M, N]
        part_ptrs = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask)


@triton.jit
def _sum_parts_kernel(part_ptr, out_ptr, M, N, stride_out, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(part_ptr + (split * M + row).to(tl.int64) * N + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def config_fits(config: dict, element_size: int) -> bool:
    """Whether a config's pipelined tiles (x and weight per stage) fit the shared-memory budget."""
    per_stage = (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * element_size
    return per_stage * config["num_stages"] <= SHARED_MEMORY_BUDGET


def default_config(m: int, n: int, k: int) -> dict:
    """A config for `m` rows when the dispatch table gives none: 64 columns a program, split K until the
    programs cover a GPU's SMs about twice."""
    split = 1
    while cdiv(n, 64) * split < 256 and k // (split * 2) >= 1024:
        split *= 2
    return {"BLOCK_M": 16 if m <= 16 else 32, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 4}


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: Optional[dict] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (M <= MAX_ROWS; unit stride along K)."""
    check_same_device(x=x, weight=weight)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"skinny_linear: x and weight dtypes differ ({x.dtype}, {weight.dtype})")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear: at most {MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    config = dict(config or default_config(m, n, k))
    config["BLOCK_M"] = max(config["BLOCK_M"], 16 if m <= 16 else 32)
    split = config["SPLIT_K"]
    k_per_split = cdiv(cdiv(k, split), config["BLOCK_K"]) * config["BLOCK_K"]
    parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _skinny_linear_kernel[(cdiv(n, config["BLOCK_N"]), split)](
        x, weight, out, parts, m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], SPLIT_K=split,
        EVEN_K=k_per_split * split == k, DOT_PRECISION=dot_precision(x.dtype), UPCAST_DOT=UPCAST_DOT_OPERANDS,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if split > 1:
        block = min(triton.next_power_of_2(n), 1024)
        _sum_parts_kernel[(m, cdiv(n, block))](parts, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=block,
                                               num_warps=4)
    return out


@functools.lru_cache(maxsize=1)
def load_dispatch_table() -> dict:
    """The measured dispatch table (empty when the file is absent)."""
    return read_table(DISPATCH_TABLE_PATH)


def dispatch_key(dtype: torch.dtype, n: int, k: int) -> str:
    """Key of a weight shape in the dispatch table: `"<dtype>/<N>x<K>"`."""
    return f"{str(dtype).replace('torch.', '')}/{n}x{k}"


def lookup(table: dict, device_name: str, key: str, m: int) -> Optional[dict]:
    """The Triton config for `m` rows of `key` on `device_name`, or None (F.linear). Table format:
    {"device_name": str, "shapes": {key: [{"max_m": int, "path": "triton" | "cublas", "config": {...}}, ...]}},
    rows sorted by max_m; a call takes the first row with m <= max_m."""
    if not table or table.get("device_name") != device_name or m > MAX_ROWS:
        return None
    for row in table.get("shapes", {}).get(key, []):
        if m <= row["max_m"]:
            return row["config"] if row["path"] == "triton" else None
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, through the skinny kernel where the dispatch table measured it faster on this GPU."""
    if bias is None and x.is_cuda and x.dim() >= 2 and weight.dim() == 2:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        config = lookup(load_dispatch_table(), cuda_device_name(index),
                        dispatch_key(x.dtype, weight.shape[0], weight.shape[1]), rows)
        if config is not None:
            flat = x.reshape(rows, x.shape[-1])
            return skinny_linear(flat, weight, config).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)

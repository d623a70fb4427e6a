"""Triton kernels and path dispatch of the SwiGLU MLP activation (launched by the ops `apex::silu_mul` and
`apex::swiglu`, defined in apex_compile.ops.mlp).

- `silu_mul(gate_up)`: `silu(gate) * up` for a fused gate/up projection output `[..., 2I]` (gate first).
- `swiglu(x, w_gate, w_up)`: `silu(x @ w_gate.T) * (x @ w_up.T)` (what the compiler's fuse_swiglu pass
  emits; the down projection stays a plain linear). Two implementations, chosen per shape:
    * "cublas": torch GEMM(s) then the Triton silu_mul kernel. When w_up directly follows w_gate in one
      `[2I, H]` buffer, a single GEMM over the buffer produces gate and up together ("cublas_split" keeps
      two GEMMs there, for the sizes where cuBLAS picks a slower algorithm for the merged one).
    * "fused": one Triton GEMM computing the gate and up tiles of the same output columns side by side with
      the SiLU-mul epilogue (both weights read once, gate/up never written to memory); for decode sizes.
  The choice comes from `swiglu_dispatch.json`, written by `benchmarks/triton_kernels.py --write-dispatch`
  on the GPU it describes (its rows between 16 and 32 rows by `benchmarks/gemm_rows.py --write-dispatch`). Shapes, dtypes or GPUs the table does not cover take the cuBLAS path.

Numerics follow HF's `act_fn(gate_proj(x)) * up_proj(x)`: gate and up rounded to x's dtype, SiLU rounded to
x's dtype, then the product rounded once more.
"""
import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from apex_compile.kernels._common import (
    UPCAST_DOT_OPERANDS,
    cdiv,
    check_float_dtype,
    check_same_device,
    cuda_device_name,
    dot_precision,
    next_pow2,
    read_table,
)

DISPATCH_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swiglu_dispatch.json")
SHARED_MEMORY_BUDGET = 160 * 1024
"""Bytes of shared memory a fused-GEMM config may plan for (Hopper allows 227 KiB per block)."""


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_gate, stride_up, stride_out,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fused_kernel(
    x_ptr, w_gate_ptr, w_up_ptr, out_ptr, M, N, K,
    stride_x, stride_w_gate, stride_w_up, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # Programs sharing an N tile are adjacent, so the M tiles of a weight tile run together (L2 reuse).
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles
    pid_n = pid // num_m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_gate_ptrs = w_gate_ptr + offs_n[None, :].to(tl.int64) * stride_w_gate + offs_k[:, None]
    w_up_ptrs = w_up_ptr + offs_n[None, :].to(tl.int64) * stride_w_up + offs_k[:, None]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w_gate = tl.load(w_gate_ptrs, mask=n_mask[None, :], other=0.0)
            w_up = tl.load(w_up_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_gate = tl.load(w_gate_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            w_up = tl.load(w_up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_gate_ptrs += BLOCK_K
        w_up_ptrs += BLOCK_K
    out_dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(out_dtype).to(tl.float32)
    up = acc_up.to(out_dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, (act * up).to(out_dtype), mask=m_mask[:, None] & n_mask[None, :])


def silu_mul_pair_launch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """Triton `out = silu(gate) * up` for 2-D `[M, I]` tensors whose rows are contiguous (any row stride)."""
    rows, cols = gate.shape
    if rows == 0 or cols == 0:
        return
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        if t.shape != (rows, cols) or t.stride(1) != 1:
            raise ValueError(f"silu_mul: {name} must be [{rows}, {cols}] with unit column stride, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    block = min(2048, next_pow2(cols))
    _silu_mul_kernel[(rows, cdiv(cols, block))](
        gate, up, out, cols, gate.stride(0), up.stride(0), out.stride(0),
        BLOCK=block, num_warps=4 if block >= 1024 else 1,
    )


def check_gate_up(gate_up: torch.Tensor) -> None:
    """Raises unless gate_up is a float tensor [..., 2I] (gate first)."""
    check_float_dtype("silu_mul gate_up", gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(f"silu_mul: last dimension of gate_up must be even (gate, up), got {tuple(gate_up.shape)}")


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Checks gate_up [..., 2I] and runs the Triton kernel into a new [..., I] tensor."""
    check_gate_up(gate_up)
    inter = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * inter)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    silu_mul_pair_launch(flat[:, :inter], flat[:, inter:], out)
    return out.view(*gate_up.shape[:-1], inter)


# ----------------------------------------------------------------------------------------------------------
# swiglu: cuBLAS + silu_mul, or the fused gate/up GEMM


def merged_gate_up_weight(w_gate: torch.Tensor, w_up: torch.Tensor) -> Optional[torch.Tensor]:
    """The `[2I, H]` view over both weights when w_up directly follows w_gate in one buffer, else None."""
    if w_gate.dim() != 2 or w_up.shape != w_gate.shape or w_up.dtype != w_gate.dtype:
        return None
    inter, hidden = w_gate.shape
    if w_gate.stride() != (hidden, 1) or w_up.stride() != (hidden, 1):
        return None
    if w_gate.untyped_storage().data_ptr() != w_up.untyped_storage().data_ptr():
        return None
    if w_up.storage_offset() != w_gate.storage_offset() + inter * hidden:
        return None
    return w_gate.as_strided((2 * inter, hidden), (hidden, 1))


def _swiglu_cublas(x2: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, one_gemm: bool) -> torch.Tensor:
    inter = w_gate.shape[0]
    merged = merged_gate_up_weight(w_gate, w_up) if one_gemm else None
    if merged is not None:
        gate_up = F.linear(x2, merged)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate, up = F.linear(x2, w_gate), F.linear(x2, w_up)
    out = torch.empty(x2.shape[0], inter, dtype=x2.dtype, device=x2.device)
    silu_mul_pair_launch(gate, up, out)
    return out


def fused_config_fits(config: dict, element_size: int) -> bool:
    """Whether a fused-GEMM config's pipelined tiles (x + two weight tiles per stage) fit the smem budget."""
    per_stage = (config["BLOCK_M"] + 2 * config["BLOCK_N"]) * config["BLOCK_K"] * element_size
    return per_stage * config["num_stages"] <= SHARED_MEMORY_BUDGET


def default_fused_config(m: int, dtype: torch.dtype) -> dict:
    """A conservative fused-GEMM config for `m` rows (used when the dispatch table gives none)."""
    block_m = min(64, max(16, next_pow2(m)))
    config = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128 if dtype != torch.float32 else 64,
              "num_warps": 4, "num_stages": 4}
    element_size = torch.empty((), dtype=dtype).element_size()
    while config["num_stages"] > 2 and not fused_config_fits(config, element_size):
        config["num_stages"] -= 1
    return config


def swiglu_fused_launch(x2: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                        config: Optional[dict] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fused Triton gate/up GEMM + SiLU-mul for 2-D x `[M, H]`; returns `[M, I]` (written into `out`,
    a contiguous `[M, I]` tensor, when given)."""
    m, k = x2.shape
    n = w_gate.shape[0]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if w_gate.stride(1) != 1:
        w_gate = w_gate.contiguous()
    if w_up.stride(1) != 1:
        w_up = w_up.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    elif out.shape != (m, n) or not out.is_contiguous() or out.dtype != x2.dtype:
        raise ValueError(f"swiglu: out must be a contiguous {x2.dtype} [{m}, {n}] tensor")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    config = config or default_fused_config(m, x2.dtype)
    grid = (cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]),)
    _swiglu_fused_kernel[grid](
        x2, w_gate, w_up, out, m, n, k,
        x2.stride(0), w_gate.stride(0), w_up.stride(0), out.stride(0),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        EVEN_K=k % config["BLOCK_K"] == 0, DOT_PRECISION=dot_precision(x2.dtype), UPCAST_DOT=UPCAST_DOT_OPERANDS,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out


@functools.lru_cache(maxsize=1)
def load_dispatch_table() -> dict:
    """The measured swiglu dispatch table (empty when the file is absent)."""
    return read_table(DISPATCH_TABLE_PATH)


def dispatch_key(dtype: torch.dtype, hidden: int, inter: int) -> str:
    """Key of a shape in the dispatch table: `"<dtype>/<hidden>x<intermediate>"`."""
    return f"{str(dtype).replace('torch.', '')}/{hidden}x{inter}"


def lookup_swiglu_path(table: dict, device_name: str, key: str, m: int, merged: bool) -> tuple[str, Optional[dict]]:
    """(path, config) for `m` rows of shape `key` on `device_name` per `table`: ("fused", config),
    ("cublas", None) or, for merged weights, ("cublas_split", None) when two GEMMs beat one over the buffer.

    Table format: {"device_name": str, "shapes": {key: [{"max_m": int, "merged": path, "separate": path,
    "config": {...}}, ...]}} with rows sorted by max_m; a call takes the first row with m <= max_m.
    Anything not covered (other GPU, shape, dtype, larger m) takes the cuBLAS path.
    """
    if not table or table.get("device_name") != device_name:
        return "cublas", None
    for row in table.get("shapes", {}).get(key, []):
        if m <= row["max_m"]:
            path = row["merged" if merged else "separate"]
            if path == "fused":
                return path, row["config"]
            return (path if path == "cublas_split" and merged else "cublas"), None
    return "cublas", None


def choose_swiglu_path(x2: torch.Tensor, w_gate: torch.Tensor, merged: bool) -> tuple[str, Optional[dict]]:
    """The measured choice for this call (cuBLAS for CPU tensors and anything unmeasured)."""
    if not x2.is_cuda:
        return "cublas", None
    index = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    key = dispatch_key(x2.dtype, x2.shape[1], w_gate.shape[0])
    return lookup_swiglu_path(load_dispatch_table(), cuda_device_name(index), key, x2.shape[0], merged)


def check_swiglu_inputs(x, w_gate, w_up):
    """Raises unless x [..., H] and two weights [I, H] of x's dtype share x's device."""
    check_float_dtype("swiglu x", x)
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or x.shape[-1] != w_gate.shape[1]:
        raise ValueError(f"swiglu: x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}: "
                         "expected x [..., H] and two weights [I, H]")
    if w_gate.dtype != x.dtype or w_up.dtype != x.dtype:
        raise TypeError(f"swiglu: dtypes differ: x {x.dtype}, w_gate {w_gate.dtype}, w_up {w_up.dtype}")
    check_same_device(x=x, w_gate=w_gate, w_up=w_up)


def swiglu_triton(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, path: Optional[str] = None,
                  config: Optional[dict] = None) -> torch.Tensor:
    """The GPU implementation; `path` overrides the dispatch table (tests, benchmarks): "fused", "cublas" (one
    GEMM over merged weights, else two) or "cublas_split" (always two GEMMs)."""
    check_swiglu_inputs(x, w_gate, w_up)
    x2 = x.reshape(-1, x.shape[-1])
    if path is None:
        path, config = choose_swiglu_path(x2, w_gate, merged_gate_up_weight(w_gate, w_up) is not None)
    if path == "fused":
        out = swiglu_fused_launch(x2, w_gate, w_up, config)
    elif path in ("cublas", "cublas_split"):
        out = _swiglu_cublas(x2, w_gate, w_up, one_gemm=path == "cublas")
    else:
        raise ValueError(f"swiglu: unknown path {path!r}")
    return out.view(*x.shape[:-1], w_gate.shape[0])

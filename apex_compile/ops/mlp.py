"""SwiGLU MLP activation ops: `apex::silu_mul` and `apex::swiglu`.

- `silu_mul(gate_up)`: `silu(gate) * up` for a fused gate/up projection output `[..., 2I]` (gate first).
- `swiglu(x, w_gate, w_up)`: `silu(x @ w_gate.T) * (x @ w_up.T)` (what the compiler's fuse_swiglu pass emits).

CUDA: the Triton kernels and per-shape path choice of apex_compile.kernels.swiglu; CPU: the same under
TRITON_INTERPRET=1, plain torch otherwise. Numerics follow HF's `act_fn(gate_proj(x)) * up_proj(x)`.
"""
import torch
import torch.nn.functional as F

from apex_compile.kernels._common import INTERPRET
from apex_compile.kernels.swiglu import check_gate_up, check_swiglu_inputs, silu_mul_triton, swiglu_triton
from apex_compile.ops._library import LIB, PT2_COMPLIANT, no_autograd_formula

LIB.define("silu_mul(Tensor gate_up) -> Tensor", tags=PT2_COMPLIANT)
LIB.define("swiglu(Tensor x, Tensor w_gate, Tensor w_up) -> Tensor", tags=PT2_COMPLIANT)


@torch.library.register_fake("apex::silu_mul", lib=LIB)
def _silu_mul_fake(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.register_fake("apex::swiglu", lib=LIB)
def _swiglu_fake(x, w_gate, w_up):
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain torch `silu(gate) * up` (the CPU path of `apex::silu_mul`)."""
    check_gate_up(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up).contiguous()


def swiglu_torch(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Plain torch `silu(x @ w_gate.T) * (x @ w_up.T)`, as HF's LlamaMLP computes it (the CPU path)."""
    check_swiglu_inputs(x, w_gate, w_up)
    return (F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)).contiguous()


def _silu_mul_cpu(gate_up):
    return silu_mul_triton(gate_up) if INTERPRET else silu_mul_torch(gate_up)


def _swiglu_cuda(x, w_gate, w_up):
    return swiglu_triton(x, w_gate, w_up)


def _swiglu_cpu(x, w_gate, w_up):
    return swiglu_triton(x, w_gate, w_up) if INTERPRET else swiglu_torch(x, w_gate, w_up)


LIB.impl("silu_mul", silu_mul_triton, "CUDA")
LIB.impl("silu_mul", _silu_mul_cpu, "CPU")
LIB.impl("swiglu", _swiglu_cuda, "CUDA")
LIB.impl("swiglu", _swiglu_cpu, "CPU")
no_autograd_formula("silu_mul")
no_autograd_formula("swiglu")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate_up[..., :I]) * gate_up[..., I:]` as a new `[..., I]` tensor (HF SwiGLU numerics)."""
    return torch.ops.apex.silu_mul(gate_up)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """`silu(x @ w_gate.T) * (x @ w_up.T)`: cuBLAS + Triton silu_mul or the fused Triton GEMM, per measurement."""
    return torch.ops.apex.swiglu(x, w_gate, w_up)

"""`apex::rms_norm`: fused residual add + RMSNorm with HuggingFace LlamaRMSNorm numerics.

    residual_out = x + residual            (in x's dtype; a copy of x when no residual is given)
    y = weight * (residual_out_fp32 * rsqrt(mean(residual_out_fp32 ** 2) + eps)).to(x.dtype)

CUDA: the Triton kernel (apex_compile.kernels.rms_norm); CPU: the same kernel under TRITON_INTERPRET=1,
plain torch otherwise.
"""
from typing import Optional

import torch

from apex_compile.kernels._common import INTERPRET
from apex_compile.kernels.rms_norm import check_rms_norm_inputs, rms_norm_triton
from apex_compile.ops._library import LIB, PT2_COMPLIANT, no_autograd_formula

LIB.define("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual=None) -> (Tensor, Tensor)",
           tags=PT2_COMPLIANT)


@torch.library.register_fake("apex::rms_norm", lib=LIB)
def _rms_norm_fake(x, weight, eps, residual=None):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.shape)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch implementation, operation for operation LlamaRMSNorm (the CPU path of `apex::rms_norm`)."""
    check_rms_norm_inputs(x, weight, residual)
    x = x.contiguous()
    hidden = x + residual.contiguous() if residual is not None else x.clone()
    hidden_f32 = hidden.to(torch.float32)
    variance = hidden_f32.pow(2).mean(-1, keepdim=True)
    y = weight * (hidden_f32 * torch.rsqrt(variance + eps)).to(hidden.dtype)
    return y.contiguous(), hidden


def _rms_norm_cpu(x, weight, eps, residual=None):
    if INTERPRET:
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


LIB.impl("rms_norm", rms_norm_triton, "CUDA")
LIB.impl("rms_norm", _rms_norm_cpu, "CPU")
no_autograd_formula("rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `residual_out = x + residual; y = LlamaRMSNorm(residual_out)`; returns `(y, residual_out)`.

    Without `residual`, residual_out is a copy of x. Runs the Triton kernel on CUDA (and on CPU under
    TRITON_INTERPRET=1), plain torch on CPU otherwise. Same numerics as HuggingFace LlamaRMSNorm.
    """
    return torch.ops.apex.rms_norm(x, weight, eps, residual)

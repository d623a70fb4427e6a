"""`apex::qkv_linear`: the q, k and v projections of one attention layer as one GEMM; `apex::linear`: a
bias-free linear whose decode-sized calls take the skinny Triton GEMM where it was measured faster.

    qkv_linear(x [..., K], w_q [Nq, K], w_k [Nk, K], w_v [Nv, K], b_q?, b_k?, b_v?) -> [..., Nq + Nk + Nv]

The result holds q, k and v side by side (what the compiler's fuse_qkv pass slices). When the three weights
lie back to back in one buffer (`merge_projection_weights` lays them so), one GEMM reads the merged
[Nq + Nk + Nv, K] view, as vLLM's QKVParallelLinear does: at decode sizes the small K/V GEMMs alone run far
under the HBM rate, and a layer's projections become one kernel instead of three (plus split-K reductions).
Other weights take three GEMMs and a concatenation. Each output column is F.linear's dot product (the GEMM may
sum it in another order).

    linear(x [..., K], w [N, K]) -> [..., N]

On CUDA both ops send their GEMM through `apex_compile.kernels.skinny_linear.linear`: the skinny kernel for the
shapes and row counts its dispatch table measured faster than cuBLAS on this GPU, F.linear otherwise.
"""
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from apex_compile.kernels import skinny_linear as _skinny
from apex_compile.ops._library import LIB, PT2_COMPLIANT, no_autograd_formula

LIB.define("qkv_linear(Tensor x, Tensor w_q, Tensor w_k, Tensor w_v, Tensor? b_q=None, Tensor? b_k=None, "
           "Tensor? b_v=None) -> Tensor", tags=PT2_COMPLIANT)
LIB.define("linear(Tensor x, Tensor weight) -> Tensor", tags=PT2_COMPLIANT)


def _check(x, weights, biases) -> None:
    in_features = weights[0].shape[-1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != in_features:
            raise ValueError(f"qkv_linear: weights must be 2-d [N, {in_features}], got {tuple(w.shape)}")
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"qkv_linear: weight {w.dtype} on {w.device} does not match x {x.dtype} on {x.device}")
    if x.shape[-1] != in_features:
        raise ValueError(f"qkv_linear: x has {x.shape[-1]} features, the weights {in_features}")
    present = [b is not None for b in biases]
    if any(present) and not all(present):
        raise ValueError("qkv_linear: give all three biases or none")
    for w, b in zip(weights, biases):
        if b is not None and b.shape != (w.shape[0],):
            raise ValueError(f"qkv_linear: bias of shape {tuple(b.shape)} for a weight of {w.shape[0]} rows")


def merged_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One view over `tensors` concatenated along dim 0 when they are contiguous and back to back in one
    storage (same dtype, device and trailing shape), else None."""
    first = tensors[0]
    step = first[0].numel() if first.dim() > 1 else 1
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.shape[1:] != first.shape[1:] or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    stride = (step,) + tuple(first.stride()[1:])
    return first.as_strided((rows,) + tuple(first.shape[1:]), stride)


def qkv_linear_torch(x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None, gemm=F.linear) -> torch.Tensor:
    """One GEMM over back-to-back weights, else three GEMMs concatenated (`gemm`: F.linear's signature)."""
    weights, biases = (w_q, w_k, w_v), (b_q, b_k, b_v)
    _check(x, weights, biases)
    merged = merged_view(weights)
    merged_bias = None if b_q is None else merged_view(biases)
    if merged is not None and (b_q is None or merged_bias is not None):
        return gemm(x, merged, merged_bias)
    return torch.cat([gemm(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def qkv_linear_cuda(x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None) -> torch.Tensor:
    return qkv_linear_torch(x, w_q, w_k, w_v, b_q, b_k, b_v, gemm=_skinny.linear)


def _check_linear(x, weight) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"apex.linear: x [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"apex.linear: weight {weight.dtype} on {weight.device} does not match x {x.dtype} on "
                         f"{x.device}")


def linear_cuda(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_linear(x, weight)
    return _skinny.linear(x, weight)


def linear_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_linear(x, weight)
    return F.linear(x, weight)


@torch.library.register_fake("apex::qkv_linear", lib=LIB)
def _qkv_linear_fake(x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None):
    return x.new_empty(*x.shape[:-1], w_q.shape[0] + w_k.shape[0] + w_v.shape[0])


LIB.impl("qkv_linear", qkv_linear_cuda, "CUDA")
LIB.impl("qkv_linear", qkv_linear_torch, "CPU")
no_autograd_formula("qkv_linear")


@torch.library.register_fake("apex::linear", lib=LIB)
def _linear_fake(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


LIB.impl("linear", linear_cuda, "CUDA")
LIB.impl("linear", linear_cpu, "CPU")
no_autograd_formula("linear")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` (the skinny Triton GEMM on CUDA where measured faster, F.linear otherwise)."""
    return torch.ops.apex.linear(x, weight)


def qkv_linear(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
               b_q: Optional[torch.Tensor] = None, b_k: Optional[torch.Tensor] = None,
               b_v: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`cat([x @ w_q.T + b_q, x @ w_k.T + b_k, x @ w_v.T + b_v], -1)`, one GEMM over merged weights."""
    return torch.ops.apex.qkv_linear(x, w_q, w_k, w_v, b_q, b_k, b_v)


# Sibling projections that read the same input: merged so that one GEMM (qkv_linear, swiglu's merged path)
# serves them.
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def merge_projection_weights(model: torch.nn.Module) -> int:
    """Moves each module's q/k/v (and gate/up) Linear weights and biases into one buffer, back to back, as
    views; values are unchanged. Returns how many groups were merged (already merged groups count too)."""
    merged = 0
    for module in model.modules():
        for names in PROJECTION_GROUPS:
            linears: List = [getattr(module, n, None) for n in names]
            if not all(isinstance(lin, torch.nn.Linear) for lin in linears):
                continue
            weights = [lin.weight for lin in linears]
            first = weights[0]
            if any(w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1]
                   for w in weights):
                continue
            biases = [lin.bias for lin in linears]
            if any(b is not None for b in biases) and not all(b is not None for b in biases):
                continue
            for params in (weights, biases if biases[0] is not None else []):
                if params and merged_view([p.data for p in params]) is None:
                    with torch.no_grad():
                        buffer = torch.cat([p.data for p in params])
                    row = 0
                    for p in params:
                        p.data = buffer[row:row + p.shape[0]]
                        row += p.shape[0]
            merged += 1
    return merged

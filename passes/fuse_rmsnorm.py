"""fuse_rmsnorm: the RMSNorm chain (and the residual add feeding it) -> `torch.ops.apex.rms_norm`.

Matched chain (HF LlamaRMSNorm and its copies), in any of dynamo's op forms:

    h  = a + b                       # optional residual add; all its other users get residual_out
    hf = h.to(float32)               # optional
    y  = weight * (hf * rsqrt(mean(hf ** 2, -1, keepdim=True) + eps)).to(h.dtype)   # cast optional

becomes `y, residual_out = apex.rms_norm(b, weight, eps, residual=a)` (or `rms_norm(h, weight, eps)`).
"""
import operator
from typing import Optional

import torch.fx as fx

from apex_compile.passes.graph_utils import (
    KERNEL_DTYPES, apex_op, arg, constant_scalar, dtype_of, eliminate_dead_code, insert_call, is_op, latest,
    node_order, only_user, other_arg, same_shape, same_size, static_shape)
from apex_compile.passes.report import PassReport

PASS = "fuse_rmsnorm"


class _Chain:
    """The nodes of one matched RMSNorm: input `x` (h), `weight`, `eps`, and output `y`."""

    def __init__(self, x: fx.Node, weight: fx.Node, eps: float, y: fx.Node):
        self.x, self.weight, self.eps, self.y = x, weight, eps, y


def _is_last_dim_mean(mean: fx.Node, ndim: int) -> bool:
    dim = arg(mean, 1, "dim")
    keepdim = arg(mean, 2, "keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return keepdim is True and dim in (-1, ndim - 1)


def _is_square(node: fx.Node, base: fx.Node) -> bool:
    if is_op(node, "pow"):
        return arg(node, 0, "input") is base and arg(node, 1, "exponent") in (2, 2.0)
    return is_op(node, "mul") and arg(node, 0, "input") is base and arg(node, 1, "other") is base


def _match(rsqrt: fx.Node) -> "_Chain | str":
    """Matches the chain around one rsqrt node; returns the chain or the reason it does not match."""
    eps_add = arg(rsqrt, 0, "input")
    if not is_op(eps_add, "add") or only_user(eps_add) is not rsqrt:
        return "rsqrt input is not a single-use `variance + eps`"
    first, second = arg(eps_add, 0, "input"), arg(eps_add, 1, "other")
    mean, eps_arg = (first, second) if is_op(first, "mean") else (second, first)
    if not is_op(mean, "mean") or only_user(mean) is not eps_add:
        return "no single-use mean(...) under `+ eps`"
    eps = constant_scalar(eps_arg)
    if eps is None:
        return "eps is not a compile-time constant"
    square = arg(mean, 0, "input")
    if not isinstance(square, fx.Node) or only_user(square) is not mean:
        return "mean input is not a single-use square"
    hf = arg(square, 0, "input")
    if not _is_square(square, hf):
        return "mean input is not x ** 2"
    shape = static_shape(hf)
    if shape is None or not _is_last_dim_mean(mean, len(shape)):
        return "mean is not over the last dim with keepdim=True"
    normed = only_user(rsqrt)
    if normed is None or not is_op(normed, "mul") or other_arg(normed, rsqrt) is not hf:
        return "rsqrt is not used once as x * rsqrt(...)"
    x = arg(hf, 0, "self") if is_op(hf, "cast") else hf
    scaled, out = normed, only_user(normed)
    if is_op(out, "cast"):
        scaled, out = out, only_user(out)
    if out is None or not is_op(out, "mul"):
        return "no single `weight * normed` after the norm (a norm without weight?)"
    weight = other_arg(out, scaled)
    weight_shape = static_shape(weight)
    if weight_shape is None or len(weight_shape) != 1 or not same_size(weight_shape[0], shape[-1]):
        return f"the output multiply is not by a [hidden] weight (got {weight_shape})"
    if not (dtype_of(weight) == dtype_of(x) == dtype_of(out)):
        return (f"dtypes differ (x {dtype_of(x)}, weight {dtype_of(weight)}, out {dtype_of(out)}); "
                "the fused op keeps one dtype")
    if dtype_of(x) not in KERNEL_DTYPES:
        return f"dtype {dtype_of(x)} is not supported by the fused kernel"
    return _Chain(x, weight, eps, out)


def _residual_inputs(x: fx.Node) -> Optional[tuple]:
    """(x, residual) operands when the norm input is a non-broadcasting add of two tensors."""
    if not is_op(x, "add") or x.kwargs.get("alpha") is not None or len(x.args) != 2:
        return None
    a, b = x.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    if same_shape(a, b) and same_shape(a, x) and dtype_of(a) == dtype_of(b) == dtype_of(x):
        return b, a
    return None


def fuse_rmsnorm(gm: fx.GraphModule, report: PassReport) -> int:
    """Rewrites every matching RMSNorm chain to `apex.rms_norm`; returns how many were rewritten."""
    rms_norm = apex_op("rms_norm")
    rsqrts = [n for n in gm.graph.nodes if is_op(n, "rsqrt")]
    if rms_norm is None:
        for node in rsqrts:
            report.missed(PASS, node, "torch.ops.apex.rms_norm is not registered")
        return 0
    fused = 0
    for rsqrt in rsqrts:
        chain = _match(rsqrt)
        if isinstance(chain, str):
            report.missed(PASS, rsqrt, chain)
            continue
        if _rewrite(gm.graph, chain, rms_norm):
            fused += 1
            report.rewritten("rms_norm", chain.y, f"eps={chain.eps:g}")
        else:
            report.missed(PASS, rsqrt, "the residual sum is used before the norm's weight is computed")
    eliminate_dead_code(gm)
    return fused


def _rewrite(graph: fx.Graph, chain: _Chain, rms_norm) -> bool:
    order = node_order(graph)
    residual = _residual_inputs(chain.x)
    inputs = [chain.weight] + (list(residual) if residual else [chain.x])
    anchor = latest(inputs, order)
    if residual and any(order[u] <= order[anchor] for u in chain.x.users):
        return False
    with graph.inserting_after(anchor):
        if residual:
            fused = insert_call(graph, "call_function", rms_norm,
                                (residual[0], chain.weight, chain.eps), {"residual": residual[1]}, like=chain.y)
        else:
            fused = insert_call(graph, "call_function", rms_norm, (chain.x, chain.weight, chain.eps),
                                like=chain.y)
    with graph.inserting_after(fused):
        y = insert_call(graph, "call_function", operator.getitem, (fused, 0), like=chain.y)
    chain.y.replace_all_uses_with(y)
    if residual:
        with graph.inserting_after(y):
            summed = insert_call(graph, "call_function", operator.getitem, (fused, 1), like=chain.x)
        chain.x.replace_all_uses_with(summed)
    return True

"""fuse_qkv: the q, k and v projections of an attention layer -> one `apex.qkv_linear` and three slices.

    q = linear(x, w_q[, b_q]); k = linear(x, w_k[, b_k]); v = linear(x, w_v[, b_v])
        ->  qkv = apex.qkv_linear(x, w_q, w_k, w_v[, b_q, b_k, b_v]); q, k, v = qkv[..., :Nq], ...

A node read by exactly three linears of the same input width is an attention layer's normed input in the
LLaMA family (the MLP's gate/up pair is fused by fuse_swiglu, every other linear reads its own input). The op
runs one GEMM when the engine has merged the weights into one buffer (`merge_projection_weights`), else three.
"""
import operator

import torch.fx as fx

from apex_compile.passes.graph_utils import KERNEL_DTYPES, apex_op, arg, dtype_of, eliminate_dead_code, insert_call
from apex_compile.passes.graph_utils import is_op, node_order, static_shape
from apex_compile.passes.report import PassReport

PASS = "fuse_qkv"


def _group(x: fx.Node, order: dict):
    """The three linears reading `x` (graph order) as (linears, weights, biases), or a reason string."""
    linears = sorted((u for u in x.users if is_op(u, "linear") and arg(u, 0, "input") is x), key=order.__getitem__)
    if len(linears) != 3:
        return None
    weights = [arg(n, 1, "weight") for n in linears]
    biases = [arg(n, 2, "bias") for n in linears]
    shapes = [static_shape(w) for w in weights]
    if any(s is None or len(s) != 2 or not isinstance(s[0], int) for s in shapes):
        return "projection weights are not 2-d with static shapes"
    if len({s[1] for s in shapes}) != 1:
        return "projections have different input widths"
    if any(b is not None for b in biases) and not all(isinstance(b, fx.Node) for b in biases):
        return "some projections have a bias and some do not"
    if dtype_of(x) not in KERNEL_DTYPES or any(dtype_of(w) != dtype_of(x) for w in weights):
        return f"dtype {dtype_of(x)} (weights and input must share a float dtype)"
    return linears, weights, biases, [s[0] for s in shapes]


def fuse_qkv(gm: fx.GraphModule, report: PassReport) -> int:
    """Rewrites every q/k/v projection triple of `gm` to `apex.qkv_linear`; returns the count."""
    op = apex_op("qkv_linear")
    graph, fused = gm.graph, 0
    order = node_order(graph)
    for x in list(graph.nodes):
        found = _group(x, order)
        if found is None:
            continue
        if isinstance(found, str):
            report.missed(PASS, x, found)
            continue
        if op is None:
            report.missed(PASS, x, "torch.ops.apex.qkv_linear is not registered")
            continue
        linears, weights, biases, rows = found
        args = (x, *weights) + (tuple(biases) if biases[0] is not None else ())
        with graph.inserting_before(linears[0]):
            qkv = insert_call(graph, "call_function", op, args, like=linears[0])
            start = 0
            for linear, count in zip(linears, rows):
                part = insert_call(graph, "call_function", operator.getitem,
                                   (qkv, (Ellipsis, slice(start, start + count))), like=linear)
                linear.replace_all_uses_with(part)
                start += count
        for linear in linears:
            graph.erase_node(linear)
        fused += 1
        report.rewritten("qkv", qkv, "+".join(str(r) for r in rows))
    eliminate_dead_code(gm)
    return fused

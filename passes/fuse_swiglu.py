"""fuse_swiglu: the SwiGLU MLP's gate/up projections + SiLU + mul -> the fused apex ops.

- Separate projections (Llama, Mistral, Qwen2):
      silu(linear(x, w_gate)) * linear(x, w_up)   ->  apex.swiglu(x, w_gate, w_up)
- One gate_up projection split in two halves (Phi-3 style):
      gate, up = gate_up.chunk(2, dim=-1); silu(gate) * up   ->  apex.silu_mul(gate_up)
The down projection after the product stays a plain linear (it is one GEMM either way).
"""
import torch.fx as fx

from apex_compile.passes.graph_utils import (
    KERNEL_DTYPES, apex_op, arg, dtype_of, eliminate_dead_code, insert_call, is_op, only_user, static_shape)
from apex_compile.passes.report import PassReport

PASS = "fuse_swiglu"


def _operands(mul: fx.Node):
    """(silu node, other operand) of `silu(...) * other`, or None."""
    first, second = arg(mul, 0, "input"), arg(mul, 1, "other")
    if is_op(first, "silu"):
        return first, second
    if is_op(second, "silu"):
        return second, first
    return None


def _linear_parts(node: fx.Node):
    """(input, weight) of a bias-free `linear` node, or None."""
    if not is_op(node, "linear") or arg(node, 2, "bias") is not None:
        return None
    return arg(node, 0, "input"), arg(node, 1, "weight")


def _match_separate(silu: fx.Node, up: fx.Node):
    """(x, w_gate, w_up) for silu(linear(x, w_gate)) * linear(x, w_up); otherwise the reason as a string."""
    gate = arg(silu, 0, "input")
    gate_parts, up_parts = _linear_parts(gate), _linear_parts(up)
    if gate_parts is None or up_parts is None:
        return "gate and up are not both bias-free linears"
    if gate_parts[0] is not up_parts[0]:
        return "gate and up linears read different inputs"
    if only_user(gate) is not silu or len(up.users) != 1:
        return "gate/up projections have other users"
    if static_shape(gate_parts[1]) != static_shape(up_parts[1]):
        return "gate and up weights have different shapes"
    if dtype_of(gate_parts[0]) not in KERNEL_DTYPES:
        return f"dtype {dtype_of(gate_parts[0])} is not supported by the fused kernel"
    return gate_parts[0], gate_parts[1], up_parts[1]


def _match_chunked(silu: fx.Node, up: fx.Node):
    """gate_up for silu(gate_up.chunk(2, -1)[0]) * gate_up.chunk(2, -1)[1]; otherwise None."""
    gate = arg(silu, 0, "input")
    if not (is_op(gate, "getitem") and is_op(up, "getitem")):
        return None
    chunk = gate.args[0]
    if up.args[0] is not chunk or not is_op(chunk, "chunk") or (gate.args[1], up.args[1]) != (0, 1):
        return None
    shape = static_shape(chunk.args[0])
    if arg(chunk, 1, "chunks") != 2 or shape is None or arg(chunk, 2, "dim", 0) not in (-1, len(shape) - 1):
        return None
    if set(chunk.users) != {gate, up} or only_user(gate) is not silu or len(up.users) != 1:
        return None
    if dtype_of(chunk.args[0]) not in KERNEL_DTYPES:
        return None
    return chunk.args[0]


def fuse_swiglu(gm: fx.GraphModule, report: PassReport) -> int:
    """Rewrites every matching silu(gate) * up to `apex.swiglu` / `apex.silu_mul`; returns the count."""
    swiglu, silu_mul = apex_op("swiglu"), apex_op("silu_mul")
    graph, fused = gm.graph, 0
    for mul in [n for n in graph.nodes if is_op(n, "mul")]:
        operands = _operands(mul)
        if operands is None:
            continue
        silu, up = operands
        if only_user(silu) is not mul:
            report.missed(PASS, mul, "silu output has other users")
            continue
        gate_up = _match_chunked(silu, up)
        if gate_up is not None:
            if silu_mul is None:
                report.missed(PASS, mul, "torch.ops.apex.silu_mul is not registered")
                continue
            with graph.inserting_before(mul):
                replacement = insert_call(graph, "call_function", silu_mul, (gate_up,), like=mul)
            kind = "silu_mul"
        else:
            parts = _match_separate(silu, up)
            if isinstance(parts, str):
                report.missed(PASS, mul, parts)
                continue
            if swiglu is None:
                report.missed(PASS, mul, "torch.ops.apex.swiglu is not registered")
                continue
            with graph.inserting_before(mul):
                replacement = insert_call(graph, "call_function", swiglu, parts, like=mul)
            kind = "swiglu"
        mul.replace_all_uses_with(replacement)
        fused += 1
        report.rewritten(kind, mul)
    eliminate_dead_code(gm)
    return fused

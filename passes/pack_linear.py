"""pack_linear: on a CPU, every fp32 `linear` -> oneDNN's linear on a pre-packed copy of its weight.

A CPU decode step is its weight reads, and oneDNN reads a weight in its blocked layout several times faster than
ATen's fp32 GEMM reads the plain one at decode row counts (benchmarks/results/cpu_linear_packed/). The weight
is packed at its first use and again whenever it changes in place (its version counter moves), so results never
use stale weights. Used by the engine when the graph runs eagerly on a CPU (inductor's weight freezing does the
same inside its compiled code), and, without a graph, by the engine's eager CPU step (`PackedLinears`).
"""
import weakref
from typing import Dict, Optional, Tuple

import torch
import torch.fx as fx

from apex_compile.passes.graph_utils import arg, fake, is_op
from apex_compile.passes.report import PassReport

PACK_ROWS_HINT = 8  # the row count oneDNN lays the packed weight out for (any row count works)
_packed: Dict[int, Tuple[weakref.ref, int, torch.Tensor]] = {}  # id(weight) -> (weight, its version, packed)


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN on the cached packed copy of `weight`."""
    entry = _packed.get(id(weight))
    if entry is None or entry[0]() is not weight or entry[1] != weight._version:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        entry = _packed[id(weight)] = (weakref.ref(weight), weight._version, packed)
    return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")


class PackedLinears(torch.overrides.TorchFunctionMode):
    """Within it, every fp32 CPU `F.linear` (HF's `nn.Linear` modules call it) runs as `packed_linear`: the
    eager step gets the compiled graph's oneDNN linears without a dynamo trace. Thread-local, like every
    torch function mode: other threads' linears are untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and weight.dim() == 2
                    and not torch.is_grad_enabled()):
                return packed_linear(x, weight, bias)
        return func(*args, **kwargs)


def _packable(node: fx.Node) -> bool:
    x, weight = fake(arg(node, 0, "input")), fake(arg(node, 1, "weight"))
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32)


def pack_linear(gm: fx.GraphModule, report: PassReport) -> int:
    """Points every fp32 CPU `linear` node of `gm` at `packed_linear`; returns how many (0 without oneDNN)."""
    if not available():
        return 0
    count = 0
    for node in gm.graph.nodes:
        if is_op(node, "linear") and _packable(node):
            node.target = packed_linear
            count += 1
    report.packed_linears = count
    gm.recompile()
    return count

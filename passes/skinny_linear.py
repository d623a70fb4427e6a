"""skinny_linear: bias-free CUDA linears whose weight shape the skinny GEMM's dispatch table covers on this GPU
-> `apex.linear`, which runs decode-sized calls on the skinny Triton kernel where it measured faster than
cuBLAS (`apex_compile.kernels.skinny_linear`) and every other call on F.linear.

Only shapes with a measured win are rewritten, so a GPU or model the table does not describe keeps its graph
unchanged (and inductor's own handling of those linears).
"""
import torch
import torch.fx as fx

from apex_compile.kernels import skinny_linear as sk
from apex_compile.kernels._common import cuda_device_name
from apex_compile.passes.graph_utils import apex_op, arg, fake, is_op
from apex_compile.passes.report import PassReport

PASS = "skinny_linear"


def measured_shapes(device: torch.device) -> set:
    """Dispatch keys of the weight shapes with at least one row count on the skinny kernel for `device`."""
    if device.type != "cuda":
        return set()
    table = sk.load_dispatch_table()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if table.get("device_name") != cuda_device_name(index):
        return set()
    return {key for key, rows in table.get("shapes", {}).items() if any(r["path"] == "triton" for r in rows)}


def skinny_linear(gm: fx.GraphModule, report: PassReport) -> int:
    """Points every covered bias-free CUDA `linear` of `gm` at `apex.linear`; returns how many."""
    op = apex_op("linear")
    count, shapes = 0, {}
    for node in list(gm.graph.nodes):
        if not is_op(node, "linear") or arg(node, 2, "bias") is not None or op is None:
            continue
        x, weight = fake(arg(node, 0, "input")), fake(arg(node, 1, "weight"))
        if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and x.device.type == "cuda" and x.dtype == weight.dtype):
            continue
        if x.device not in shapes:
            shapes[x.device] = measured_shapes(x.device)
        if sk.dispatch_key(weight.dtype, *weight.shape) not in shapes[x.device]:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, (arg(node, 0, "input"), arg(node, 1, "weight")))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    report.skinny_linears = count
    gm.recompile()
    return count

"""overlap: split each `apex.attention` into launch / device part / wait, launched early and awaited late.

    token = apex.offload_launch(q, k, v, layer, scale)     # D2H of host rows + CPU work submitted
    dev   = apex.device_attention(q, k, v, layer, scale, token)
    out   = apex.offload_wait(token, dev, layer)           # host rows filled in (H2D + stream wait)

The launch goes right after the last of q, k, v is computed (their token-major views are moved up with
it), the device part right after the launch, and the wait right before the first user of the attention
output that computes something (pure layout ops - reshape, transpose, contiguous - are moved down first).
Ordering is carried only by the token tensor, never by stream/event nodes, so any scheduler that respects
data dependencies (inductor does) keeps it.
"""
import torch
import torch.fx as fx

from apex_compile.passes.graph_utils import insert_call, latest, node_order
from apex_compile.passes.report import PassReport

SPLIT_FORM = "launch/device/wait"


# Pure layout methods that the passes (and HF around SDPA) put between attention and real compute.
_LAYOUT_METHODS = ("transpose", "flatten", "unflatten", "reshape", "view", "contiguous")


def _is_layout(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in _LAYOUT_METHODS


def _hoist_layout(node: fx.Node, graph: fx.Graph) -> None:
    """Moves the layout chain ending at `node` up to right after the tensor it reads."""
    if not _is_layout(node):
        return
    _hoist_layout(node.args[0], graph)
    anchor = latest(node.all_input_nodes, node_order(graph))
    if anchor is not None and anchor.next is not node:
        anchor.append(node)


def _sink_layout(node: fx.Node, graph: fx.Graph) -> None:
    """Moves the layout-only users of `node` (recursively) down to right before their own first user."""
    for user in list(node.users):
        if _is_layout(user):
            _sink_layout(user, graph)
            if user.users:
                order = node_order(graph)
                min(user.users, key=order.__getitem__).prepend(user)


def overlap_attention(gm: fx.GraphModule, report: PassReport) -> int:
    """Splits every `apex.attention` node of `gm`; returns how many were split."""
    ops = torch.ops.apex
    graph, split = gm.graph, 0
    for node in [n for n in graph.nodes if n.target is ops.attention.default]:
        q, k, v, layer_idx, scale = node.args
        for view in (q, k, v):
            _hoist_layout(view, graph)
        order = node_order(graph)
        with graph.inserting_after(latest([q, k, v], order)):
            token = insert_call(graph, "call_function", ops.offload_launch.default, (q, k, v, layer_idx, scale),
                                like=node)
        with graph.inserting_after(token):
            device_out = insert_call(graph, "call_function", ops.device_attention.default,
                                     (q, k, v, layer_idx, scale, token), like=node)
        _sink_layout(node, graph)
        order = node_order(graph)
        first_user = min(node.users, key=order.__getitem__)
        with graph.inserting_before(first_user):
            out = insert_call(graph, "call_function", ops.offload_wait.default, (token, device_out, layer_idx),
                              like=node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        split += 1
        report.rewritten("overlap", out, f"layer_idx={layer_idx}")
    for site in report.attention_sites:
        site.form = SPLIT_FORM
    gm.recompile()
    return split

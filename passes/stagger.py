"""stagger: the graph of the "staggered" plan, whose first rows advance one decoder layer per step.

In that plan (apex_compile.runtime.stagger) the step's first rows hold host-pool requests at different layers:
at layer L they belong to the requests whose layer-L attention is launched this step before the attention op,
and to the requests whose layer-L attention was launched the step before after it. Two things in the graph
carry a row's identity across that boundary besides the attention output (which the runner swaps itself):

- the residual stream: the residual add after each `apex.attention` reads the layer's input; it now reads
  `apex.stagger_residual(input, L)` (the requests leaving keep theirs, the arriving ones get theirs back);
- the RoPE tables, computed once from the step's positions before the first layer: `apex.stagger_rope_layers`
  gives every layer's table at once (the block's rows for the positions of each layer's requests), and each
  layer's uses of cos and sin read its slice.

Runs after partition_attention (attention ops numbered, the mask code gone) and before the fusions.
"""
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from apex_compile.passes.graph_utils import PatternError, arg, insert_call, is_op, layer_of, node_order, same_shape
from apex_compile.passes.report import PassReport

PASS = "stagger"
ROPE_KINDS = ("cos", "sin")


def _residual_add(attention: fx.Node, order: Dict[fx.Node, int]) -> Optional[Tuple[fx.Node, fx.Node]]:
    """(add, residual): the first add after `attention` that adds one of its descendants to a tensor that is
    not, the layer's residual add (o_proj(attention) + the layer's input)."""
    descendants: Set[fx.Node] = {attention}
    for node in list(attention.graph.nodes)[order[attention] + 1:]:
        if not any(a in descendants for a in node.all_input_nodes):
            continue
        if node.target is torch.ops.apex.attention.default:
            return None  # reached the next layer's attention
        descendants.add(node)
        if is_op(node, "add"):
            a, b = arg(node, 0, "input"), arg(node, 1, "other")
            inside = [x in descendants for x in (a, b)]
            other = b if inside[0] else a
            if inside.count(True) == 1 and isinstance(other, fx.Node) and same_shape(other, node):
                return node, other
    return None


def _rope_kind(node: fx.Node) -> Optional[str]:
    """'cos' or 'sin' when `node` computes one (any dynamo form)."""
    for kind in ROPE_KINDS:
        if (node.op == "call_method" and node.target == kind) or (
                node.op == "call_function" and node.target in (getattr(torch, kind), getattr(torch.Tensor, kind))):
            return kind
    return None


def _rope_tables(graph: fx.Graph) -> Dict[fx.Node, str]:
    """The RoPE cos/sin tensors computed outside the decoder layers and read inside them (node -> kind)."""
    tables: Dict[fx.Node, str] = {}
    for start in (n for n in graph.nodes if _rope_kind(n) and layer_of(n) is None):
        kind, frontier = _rope_kind(start), [start]
        while frontier:
            node = frontier.pop()
            inside = [u for u in node.users if layer_of(u) is not None]
            if inside:
                if tables.get(node, kind) != kind:
                    raise PatternError(f"{PASS}: {node.name} mixes the RoPE cos and sin")
                tables[node] = kind
            frontier += [u for u in node.users if layer_of(u) is None]
    return tables


def stagger_rows(gm: fx.GraphModule, report: PassReport) -> int:
    """Inserts the stagger ops at every layer (see the module docstring); returns the number of layers."""
    graph = gm.graph
    ops = torch.ops.apex
    attentions = [n for n in graph.nodes if n.target is ops.attention.default]
    if not attentions:
        raise PatternError(f"{PASS}: no apex.attention op in the graph (run partition_attention first)")
    order = node_order(graph)
    for attention in attentions:
        layer_idx = attention.args[3]
        found = _residual_add(attention, order)
        if found is None:
            raise PatternError(f"{PASS}: no residual add after the attention of layer {layer_idx}")
        add, residual = found
        with graph.inserting_before(add):
            swapped = insert_call(graph, "call_function", ops.stagger_residual.default, (residual, layer_idx),
                                  like=add)
        add.replace_input_with(residual, swapped)
    tables = _rope_tables(graph)
    kinds = sorted(tables.values())
    if kinds != sorted(ROPE_KINDS):
        raise PatternError(f"{PASS}: expected one RoPE cos and one sin table read by the layers, found {kinds}")
    order = node_order(graph)
    for table, kind in tables.items():
        by_layer: Dict[int, List[fx.Node]] = {}
        for user in table.users:
            by_layer.setdefault(layer_of(user), []).append(user)
        with graph.inserting_after(table):  # every layer's table in one op, each layer reads its slice
            every = insert_call(graph, "call_function", ops.stagger_rope_layers.default,
                                (table, len(attentions), ROPE_KINDS.index(kind)), like=table)
        for layer, users in by_layer.items():
            if layer is None:
                continue
            first = min(users, key=order.__getitem__)
            with graph.inserting_before(first):
                rows = insert_call(graph, "call_function", torch.select, (every, 0, layer), like=first)
            for user in users:
                user.replace_input_with(table, rows)
    report.staggered_layers = len(attentions)
    gm.recompile()
    return len(attentions)


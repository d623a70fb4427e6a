"""partition_attention: every `scaled_dot_product_attention` -> one `apex.attention` op per layer.

For each SDPA call (in graph order; that order is the apex layer index) the pass
- walks K and V back through HF's `repeat_kv` (`x[:, :, None].expand(...).reshape(...)`, or
  `repeat_interleave(n, dim=1)`) to the per-KV-head tensors, or uses them directly with `enable_gqa=True`;
- takes q [B, Hq, S, D] (RoPE applied), k/v [B, Hkv, S, D] and flattens them to the runner's token-major
  [B*S, H, D] (a view for HF's layouts);
- calls `apex.attention(q, k, v, layer_idx, scale)` (scale from the call, default D**-0.5) and gives the
  result back to SDPA's users as [B, Hq, S, D].
The attention mask and `is_causal` are dropped: the runner attends each request causally over its paged
cache; the mask-building code dies with them. Every SDPA must match or the pass raises `PatternError`
(a half-rewritten graph would attend some layers without the cache).
"""
import dataclasses
from typing import List, Union

import torch
import torch.fx as fx

from apex_compile.passes.graph_utils import (
    PatternError, arg, constant_scalar, eliminate_dead_code, insert_call, is_op, layer_of, module_path, same_size,
    static_shape)
from apex_compile.passes.report import AttentionSite, PassReport

PASS = "partition_attention"


@dataclasses.dataclass
class _Site:
    """One matched SDPA call."""
    sdpa: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


def find_sdpa(graph: fx.Graph) -> List[fx.Node]:
    """The scaled_dot_product_attention calls of `graph`, in graph order."""
    return [n for n in graph.nodes if is_op(n, "sdpa")]


def _strip_repeat_kv(node: fx.Node) -> fx.Node:
    """The per-KV-head tensor under HF's repeat_kv (expand + reshape, or repeat_interleave on dim 1)."""
    if is_op(node, "repeat_interleave") and arg(node, 2, "dim") == 1:
        return arg(node, 0, "input")
    if not is_op(node, "reshape") or not is_op(node.args[0], "expand"):
        return node
    expanded = node.args[0].args[0]
    if is_op(expanded, "unsqueeze") and arg(expanded, 1, "dim") == 2:
        source = arg(expanded, 0, "input")
    elif is_op(expanded, "getitem") and _is_insert_dim2(expanded.args[1]):
        source = expanded.args[0]
    else:
        return node
    source_shape, out_shape = static_shape(source), static_shape(node)
    if source_shape is None or out_shape is None or len(source_shape) != 4 or len(out_shape) != 4:
        return node
    b, hkv, s, d = source_shape
    if not all(same_size(x, y) for x, y in ((b, out_shape[0]), (s, out_shape[2]), (d, out_shape[3]))):
        return node
    return source


def _is_insert_dim2(index) -> bool:
    """Whether a getitem index is `[:, :, None, ...]` (a new axis at dim 2 of a 4-d tensor)."""
    if not isinstance(index, tuple) or len(index) < 3 or index[2] is not None:
        return False
    full = slice(None, None, None)
    return index[0] == full and index[1] == full and all(i in (full, Ellipsis) for i in index[3:])


def _where(node: fx.Node) -> str:
    path = module_path(node)
    return f"SDPA node '{node.name}'" + (f" in {path}" if path else "")


def _match(sdpa: fx.Node) -> Union[_Site, str]:
    """Matches one SDPA call; returns the site or the reason it cannot become apex.attention."""
    query, key, value = arg(sdpa, 0, "query"), arg(sdpa, 1, "key"), arg(sdpa, 2, "value")
    mask, dropout = arg(sdpa, 3, "attn_mask"), arg(sdpa, 4, "dropout_p", 0.0)
    is_causal, scale_arg = arg(sdpa, 5, "is_causal", False), arg(sdpa, 6, "scale")
    if constant_scalar(dropout) != 0.0:
        return f"dropout_p={dropout} (only inference without dropout is supported)"
    key, value = _strip_repeat_kv(key), _strip_repeat_kv(value)
    shapes = [static_shape(n) for n in (query, key, value)]
    if any(s is None or len(s) != 4 for s in shapes):
        return f"q/k/v are not 4-d tensors with recorded shapes (got {shapes})"
    (b, hq, s, d), (bk, hkv, sk, dk), (bv, hv, sv, dv) = shapes
    if not (same_size(b, bk) and same_size(b, bv)):
        return "q, k and v have different batch sizes"
    if not (same_size(s, sk) and same_size(s, sv)):
        return ("k/v have a different token count than q: past K/V flow into the graph "
                "(compile the step with use_cache=False; the runner keeps the cache)")
    if mask is None and is_causal is not True and not same_size(s, 1):
        return "attention is not causal (no mask and is_causal=False): not a decoder self-attention"
    for size, what in ((hq, "query heads"), (hkv, "key heads"), (hv, "value heads"), (d, "head_dim"),
                       (dk, "key head_dim"), (dv, "value head_dim")):
        if not isinstance(size, int):
            return f"{what} is symbolic ({size})"
    if hkv != hv or not d == dk == dv or hq % hkv:
        return f"unsupported head layout: q {hq}x{d}, k {hkv}x{dk}, v {hv}x{dv}"
    scale = d ** -0.5 if scale_arg is None else constant_scalar(scale_arg)
    if scale is None:
        return "scale is not a compile-time constant"
    return _Site(sdpa, query, key, value, hq, hkv, dv, scale)


def _check_layer_numbering(sites: List[_Site]) -> None:
    """Raises unless graph order numbers the layers as the model does (a graph break splits the model).

    apex numbers attention layers 0, 1, ... in graph order. That is the model's numbering only when this
    graph holds the whole decoder stack: the module paths dynamo records must show decoder layers 0..L-1
    (checked when SDPA runs inside modules; plain functions have no paths).
    """
    hint = ("the model was split by a graph break. Compile the step with fullgraph=True so that one graph "
            "holds every layer (a layer left outside the compiled graph would attend without the cache)")
    for site in sites:
        path = module_path(site.sdpa)
        if path and layer_of(site.sdpa) is None:
            raise PatternError(f"{PASS}: {_where(site.sdpa)} is not inside a numbered decoder layer, so this graph "
                               f"does not start at the model: {hint}")
    layers = [layer_of(site.sdpa) for site in sites]
    if None not in layers and layers != list(range(len(sites))):
        raise PatternError(f"{PASS}: the graph's attention calls belong to decoder layers {layers}, but apex "
                           f"numbers them 0..{len(sites) - 1} in graph order: {hint}")


def _flatten_tokens(graph: fx.Graph, node: fx.Node, like: fx.Node) -> fx.Node:
    """[B, H, S, D] -> [B*S, H, D] (token-major, a view for HF's transposed layouts)."""
    swapped = insert_call(graph, "call_method", "transpose", (node, 1, 2), like=like)
    return insert_call(graph, "call_method", "flatten", (swapped, 0, 1), like=like)


def partition_attention(gm: fx.GraphModule, report: PassReport) -> int:
    """Rewrites every SDPA call to `apex.attention`; returns the number of layers (raises PatternError)."""
    attention_op = torch.ops.apex.attention.default
    graph = gm.graph
    sdpas = find_sdpa(graph)
    if not sdpas:
        raise PatternError(
            f"{PASS}: no scaled_dot_product_attention call found in the graph ({len(graph.nodes)} nodes), so "
            "there is nothing to attach the paged KV cache to. attention='paged' needs a decoder whose "
            "attention runs through torch SDPA (HF attn_implementation='sdpa'); matmul/softmax ('eager') "
            "attention and custom kernels are not recognised. (If this graph is a piece split off by a graph "
            "break, compile with fullgraph=True.)")
    sites = []
    for sdpa in sdpas:
        site = _match(sdpa)
        if isinstance(site, str):
            raise PatternError(f"{PASS}: cannot rewrite {_where(sdpa)}: {site}")
        sites.append(site)
    _check_layer_numbering(sites)
    for layer_idx, site in enumerate(sites):
        _rewrite(graph, site, layer_idx, attention_op)
        report.rewritten("attention", site.sdpa, f"layer_idx={layer_idx}")
        report.attention_sites.append(AttentionSite(
            layer_idx, layer_of(site.sdpa), module_path(site.sdpa), "apex.attention",
            site.num_heads, site.num_kv_heads, site.head_dim, site.scale))
    for site in sites:
        graph.erase_node(site.sdpa)
    eliminate_dead_code(gm)
    return len(sites)


def _rewrite(graph: fx.Graph, site: _Site, layer_idx: int, attention_op) -> None:
    sdpa = site.sdpa
    batch = static_shape(site.query)[0]
    with graph.inserting_before(sdpa):
        q, k, v = (_flatten_tokens(graph, n, sdpa) for n in (site.query, site.key, site.value))
        out = insert_call(graph, "call_function", attention_op, (q, k, v, layer_idx, site.scale), like=sdpa)
        if not isinstance(batch, int):
            batch = insert_call(graph, "call_method", "size", (site.query, 0), like=sdpa)
        unflat = insert_call(graph, "call_method", "unflatten", (out, 0, (batch, -1)), like=sdpa)
        result = insert_call(graph, "call_method", "transpose", (unflat, 1, 2), like=sdpa)
    sdpa.replace_all_uses_with(result)


def describe_dense(gm: fx.GraphModule, report: PassReport) -> None:
    """Records every SDPA call as kept dense (attention='sdpa'), with its head layout when it matches."""
    for index, sdpa in enumerate(find_sdpa(gm.graph)):
        site = _match(sdpa)
        if isinstance(site, str):
            shape = static_shape(arg(sdpa, 0, "query")) or (None, None, None, None)
            heads, head_dim = shape[1], shape[-1]
            report.attention_sites.append(AttentionSite(
                index, layer_of(sdpa), module_path(sdpa), "dense SDPA", heads, heads, head_dim, None))
        else:
            report.attention_sites.append(AttentionSite(
                index, layer_of(sdpa), module_path(sdpa), "dense SDPA", site.num_heads, site.num_kv_heads,
                site.head_dim, site.scale))


"""Helpers shared by the passes: recognising torch-IR ops in dynamo graphs, reading arguments, shapes and
compile-time scalars, fake-tensor metadata for inserted nodes, and mapping nodes to decoder layers.

Dynamo hands the backend a torch-level FX graph: functions appear as `call_function` nodes on `torch`,
`torch.nn.functional` or `operator` callables, and tensor methods as `call_method` nodes. The same
operation can take several of these forms (`x.pow(2)`, `torch.pow(x, 2)`, `x ** 2`), so the passes match
by op *kind* rather than by one target.
"""
import operator
import re
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true


class PatternError(RuntimeError):
    """A pass was required to rewrite the graph (attention='paged') but a pattern did not match."""


# kind -> (call_function targets, call_method names)
_OP_KINDS: Dict[str, tuple] = {
    "add": ({operator.add, torch.add}, {"add"}),
    "mul": ({operator.mul, torch.mul}, {"mul"}),
    "pow": ({operator.pow, torch.pow}, {"pow"}),
    "mean": ({torch.mean}, {"mean"}),
    "rsqrt": ({torch.rsqrt}, {"rsqrt"}),
    "cast": (set(), {"to", "float", "type"}),
    "linear": ({F.linear}, set()),
    "silu": ({F.silu}, {"silu"}),
    "sdpa": ({F.scaled_dot_product_attention}, set()),
    "reshape": ({torch.reshape}, {"reshape", "view"}),
    "expand": (set(), {"expand"}),
    "unsqueeze": ({torch.unsqueeze}, {"unsqueeze"}),
    "getitem": ({operator.getitem}, set()),
    "repeat_interleave": ({torch.repeat_interleave}, {"repeat_interleave"}),
    "chunk": ({torch.chunk}, {"chunk"}),
}


def is_op(node: Any, kind: str) -> bool:
    """Whether `node` is an FX node computing op `kind` (a key of the table above) in any dynamo form."""
    if not isinstance(node, fx.Node):
        return False
    functions, methods = _OP_KINDS[kind]
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument `name` of a call, given positionally at `index` (counting `self` for methods) or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def fake(node: Any) -> Any:
    """The fake tensor (or symbolic scalar) that dynamo recorded for `node`; None when there is none."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value")
    return value if value is not None else node.meta.get("val")


def static_shape(node: Any) -> Optional[tuple]:
    """`node`'s shape with symbolic sizes kept symbolic; None when no tensor metadata is recorded."""
    value = fake(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def same_size(a: Any, b: Any) -> bool:
    """Whether two (possibly symbolic) sizes are provably equal, without adding guards."""
    return statically_known_true(a == b)


def same_shape(a: fx.Node, b: fx.Node) -> bool:
    """Whether two nodes' tensors provably have the same shape (no broadcasting)."""
    shape_a, shape_b = static_shape(a), static_shape(b)
    if shape_a is None or shape_b is None or len(shape_a) != len(shape_b):
        return False
    return all(same_size(x, y) for x, y in zip(shape_a, shape_b))


# Floating dtypes the fused apex kernels accept; graphs in other dtypes (e.g. float64) keep their ops.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dtype_of(node: Any) -> Optional[torch.dtype]:
    """The dtype of `node`'s tensor, or None."""
    value = fake(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def constant_scalar(value: Any) -> Optional[float]:
    """The compile-time value of a scalar argument: a Python number, or a dynamo `.item()` node.

    With `dynamic=True` dynamo turns float module attributes (RMSNorm eps, attention scaling) into tensor
    inputs read with `.item()`; their recorded symbolic float carries the traced value as its hint. The
    passes bake these values into the fused ops: they are per-module constants of the model.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, fx.Node):
        recorded = fake(value)
        if isinstance(recorded, (int, float)) and not isinstance(recorded, bool):
            return float(recorded)
        if isinstance(recorded, (torch.SymFloat, torch.SymInt)):
            hint = recorded.node.hint
            return None if hint is None else float(hint)
    return None


def only_user(node: fx.Node) -> Optional[fx.Node]:
    """The single user of `node`, or None when it has zero or several."""
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def other_arg(node: fx.Node, known: fx.Node) -> Any:
    """For a binary op node with `known` as one operand, the other operand (or None if `known` is absent)."""
    first, second = arg(node, 0, "input"), arg(node, 1, "other")
    if first is known:
        return second
    if second is known:
        return first
    return None


def infer_meta(node: fx.Node) -> None:
    """Records the fake tensor of an inserted `node` by running its target on its inputs' fake values."""
    values = torch.utils._pytree.tree_leaves([fake(n) for n in node.all_input_nodes])
    fake_modes = [v.fake_mode for v in values if isinstance(v, torch._subclasses.FakeTensor)]
    if not fake_modes:
        return
    fake_mode = fake_modes[0]
    args = fx.node.map_arg(node.args, fake)
    kwargs = fx.node.map_arg(node.kwargs, fake)
    with fake_mode:
        if node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)
    node.meta["example_value"] = value


def insert_call(graph: fx.Graph, op: str, target: Any, args: tuple, kwargs: Optional[dict] = None,
                like: Optional[fx.Node] = None) -> fx.Node:
    """Creates a call node at the graph's current insertion point, with fake metadata and `like`'s origin."""
    node = graph.create_node(op, target, args, kwargs or {})
    if like is not None:
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    infer_meta(node)
    return node


def node_order(graph: fx.Graph) -> Dict[fx.Node, int]:
    """Position of every node in the graph's (execution) order."""
    return {node: i for i, node in enumerate(graph.nodes)}


def latest(nodes: Sequence[Any], order: Dict[fx.Node, int]) -> Optional[fx.Node]:
    """The node of `nodes` (non-nodes ignored) that comes last in `order`."""
    candidates = [n for n in nodes if isinstance(n, fx.Node)]
    return max(candidates, key=order.__getitem__) if candidates else None


_LAYER_INDEX = re.compile(r"(?:\.|\[\s*'?|,\s*')(\d+)'?\s*[\])]?$")


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost module that produced `node` (dynamo's nn_module_stack), or ''."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return re.sub(r"^[^.]*\]\.", "", path)  # drop dynamo's source prefix, e.g. L['self'] or L['args'][0]


def layer_of(node: fx.Node) -> Optional[int]:
    """Index of the decoder layer (the module listed as `<container>.<i>`) that produced `node`, or None."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = _LAYER_INDEX.search(path)
        if match:
            return int(match.group(1))
    return None


_INPLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def may_mutate(node: fx.Node) -> bool:
    """Conservatively, whether `node` may have a side effect (FX's own check misses in-place methods)."""
    if node.is_impure():
        return True
    if node.op == "call_method":
        return node.target.endswith("_")
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return schema.is_mutable
        if getattr(node.target, "__module__", None) in ("operator", "_operator"):
            return node.target in _INPLACE_OPERATORS  # operator.and_ & co. are not in-place
        if "out" in node.kwargs or node.kwargs.get("inplace") is True:
            return True
        return getattr(node.target, "__name__", "").endswith("_")
    return False


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    """Removes nodes whose results are unused and that cannot mutate anything, then recompiles `gm`."""
    gm.graph.eliminate_dead_code(is_impure_node=may_mutate)
    gm.recompile()


def apex_op(name: str) -> Optional[torch._ops.OpOverload]:
    """`torch.ops.apex.<name>.default` if that op is registered (looked up lazily), else None."""
    try:
        return getattr(torch.ops.apex, name).default
    except (AttributeError, RuntimeError):
        return None

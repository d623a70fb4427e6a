"""The opaque attention ops that graphs rewritten by `partition_attention` / `overlap` call.

    apex::attention(Tensor q, Tensor k, Tensor v, int layer_idx, float scale) -> Tensor
    apex::offload_launch(Tensor q, Tensor k, Tensor v, int layer_idx, float scale) -> Tensor   (a token)
    apex::device_attention(Tensor q, Tensor k, Tensor v, int layer_idx, float scale, Tensor token) -> Tensor
    apex::offload_wait(Tensor token, Tensor device_out, int layer_idx) -> Tensor
    apex::stagger_residual(Tensor residual, int layer_idx) -> Tensor
    apex::stagger_rope_layers(Tensor table, int num_layers, int kind) -> Tensor   ([num_layers, *table.shape])

q: [T, Hq, D], k/v: [T, Hkv, D] for the step's T flattened tokens (RoPE applied); outputs [T, Hq, D].
The ops take no cache or metadata arguments: they delegate to the `AttentionRunner` the runtime installed for
the current step in `apex_compile.ops.runner_slot` (the ops import nothing of the runtime). So the KV caches
never enter a graph, functionalization has nothing to clone, and the ops are functional as far as the
compiler can see. The token of
`offload_launch` (a 1-element tensor of q's dtype on q's device) orders launch -> device part -> wait by
data dependency alone.

The two stagger ops serve the "staggered" plan (apex_compile.runtime.stagger): the step's first rows are host
requests that each advance one layer per step, so at every layer those rows belong to other requests. They
return their input with those rows swapped for the layer's own: `stagger_residual` the residual stream (the
requests leaving the layer's attention store theirs, the ones entering it get theirs back);
`stagger_rope_layers` gives every layer's RoPE cos (kind 0) or sin (kind 1) table at once, the block's rows at
the positions of each layer's requests (one op per step, each layer reads its slice). They are pure device
copies at fixed addresses, so CUDA graphs capture them.

The first four are tagged `cudagraph_unsafe` (where this torch has the tag): they run Python that reads
per-step runner state and touch the CPU, so inductor keeps them out of CUDA graphs (graph partition).
"""
import torch

from apex_compile.ops._library import LIB
from apex_compile.ops.runner_slot import current as get_attention_runner

_TAGS = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None)

LIB.define("attention(Tensor q, Tensor k, Tensor v, int layer_idx, float scale) -> Tensor", tags=_TAGS)
LIB.define("offload_launch(Tensor q, Tensor k, Tensor v, int layer_idx, float scale) -> Tensor", tags=_TAGS)
LIB.define("device_attention(Tensor q, Tensor k, Tensor v, int layer_idx, float scale, Tensor token) -> Tensor",
           tags=_TAGS)
LIB.define("offload_wait(Tensor token, Tensor device_out, int layer_idx) -> Tensor", tags=_TAGS)
LIB.define("stagger_residual(Tensor residual, int layer_idx) -> Tensor")
LIB.define("stagger_rope_layers(Tensor table, int num_layers, int kind) -> Tensor")


@torch.library.register_fake("apex::attention", lib=LIB)
def _attention_fake(q, k, v, layer_idx, scale):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.register_fake("apex::offload_launch", lib=LIB)
def _launch_fake(q, k, v, layer_idx, scale):
    return q.new_empty(1)


@torch.library.register_fake("apex::device_attention", lib=LIB)
def _device_attention_fake(q, k, v, layer_idx, scale, token):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.register_fake("apex::offload_wait", lib=LIB)
def _wait_fake(token, device_out, layer_idx):
    return torch.empty_like(device_out)


@torch.library.register_fake("apex::stagger_residual", lib=LIB)
def _stagger_residual_fake(residual, layer_idx):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.register_fake("apex::stagger_rope_layers", lib=LIB)
def _stagger_rope_layers_fake(table, num_layers, kind):
    return table.new_empty((num_layers, *table.shape))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _fresh(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """`out` as the fake impls promise it: contiguous, and copied if the runner returned (a view of) an input
    (a functional op must not alias its inputs; compiled code relies on both)."""
    if any(_shares_memory(out, t) for t in inputs):
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


def _attention(q, k, v, layer_idx, scale):
    return _fresh(get_attention_runner().attention(layer_idx, q, k, v, scale), q, k, v)


def _offload_launch(q, k, v, layer_idx, scale):
    return _fresh(get_attention_runner().offload_launch(layer_idx, q, k, v, scale), q, k, v)


def _device_attention(q, k, v, layer_idx, scale, token):
    return _fresh(get_attention_runner().device_attention(layer_idx, q, k, v, scale, token), q, k, v, token)


def _offload_wait(token, device_out, layer_idx):
    return _fresh(get_attention_runner().offload_wait(layer_idx, token, device_out), token, device_out)


def _stagger_residual(residual, layer_idx):
    return _fresh(get_attention_runner().stagger_residual(layer_idx, residual), residual)


def _stagger_rope_layers(table, num_layers, kind):
    return _fresh(get_attention_runner().stagger_rope_layers(num_layers, table, kind), table)


# Device-generic Python: the runner picks the kernels.
LIB.impl("attention", _attention, "CompositeExplicitAutograd")
LIB.impl("offload_launch", _offload_launch, "CompositeExplicitAutograd")
LIB.impl("device_attention", _device_attention, "CompositeExplicitAutograd")
LIB.impl("offload_wait", _offload_wait, "CompositeExplicitAutograd")
LIB.impl("stagger_residual", _stagger_residual, "CompositeExplicitAutograd")
LIB.impl("stagger_rope_layers", _stagger_rope_layers, "CompositeExplicitAutograd")

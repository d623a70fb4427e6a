"""GPU paged KV cache ops: `apex::cache_append_gpu`, decode `apex::paged_attention_gpu`, decode fused with the
append of the current token `apex::paged_decode_append_gpu` and causal prefill `apex::paged_prefill_attention_gpu`
(cache layout: notes/CONVENTIONS.md, "KV cache contract").

CUDA: the Triton kernels of apex_compile.kernels.paged_attention / prefill_attention. CPU tensors: the same
kernels under TRITON_INTERPRET=1; otherwise the C++ ops of apex_compile.ops.cpu_attention (append, decode,
and the two in turn for the fused op) and plain torch (prefill).
"""
from typing import Optional

import torch

from apex_compile.kernels._common import INTERPRET
from apex_compile.kernels.paged_attention import (
    cache_append_launch,
    check_block_ids,
    check_decode_append_inputs,
    paged_decode_append_launch,
    paged_decode_launch,
)
from apex_compile.kernels.prefill_attention import check_prefill_inputs, paged_prefill_launch
from apex_compile.ops._library import LIB, PT2_COMPLIANT, no_autograd_formula
from apex_compile.ops.cpu_attention import cache_append_cpu, paged_attention_cpu
from apex_compile.ops.kv_layout import gather_kv

LIB.define("cache_append_gpu(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
           "Tensor slot_mapping) -> ()", tags=PT2_COMPLIANT)
LIB.define("paged_attention_gpu(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
           "Tensor context_lens, float? scale=None, SymInt? max_context_len=None) -> Tensor", tags=PT2_COMPLIANT)
LIB.define("paged_decode_append_gpu(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, "
           "Tensor(b!) value_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, float? scale=None, "
           "SymInt? max_context_len=None) -> Tensor", tags=PT2_COMPLIANT)
LIB.define("paged_prefill_attention_gpu(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
           "Tensor query_start_loc, Tensor context_lens, float? scale=None, SymInt? max_query_len=None) -> Tensor",
           tags=PT2_COMPLIANT)


@torch.library.register_fake("apex::cache_append_gpu", lib=LIB)
def _cache_append_fake(key, value, key_cache, value_cache, slot_mapping):
    return None


@torch.library.register_fake("apex::paged_attention_gpu", lib=LIB)
def _paged_attention_fake(query, key_cache, value_cache, block_tables, context_lens, scale=None,
                          max_context_len=None):
    return query.new_empty(query.shape)


@torch.library.register_fake("apex::paged_decode_append_gpu", lib=LIB)
def _paged_decode_append_fake(query, key, value, key_cache, value_cache, slot_mapping, block_tables, context_lens,
                              scale=None, max_context_len=None):
    return query.new_empty(query.shape)


@torch.library.register_fake("apex::paged_prefill_attention_gpu", lib=LIB)
def _paged_prefill_fake(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale=None,
                        max_query_len=None):
    return query.new_empty(query.shape)


def paged_prefill_torch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                        scale=None) -> torch.Tensor:
    """Plain torch implementation (fp32 math, one sequence at a time): the CPU path of the prefill op."""
    num_kv_heads, group, _, head_dim = check_prefill_inputs(
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts = query_start_loc.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        if begin == end:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[seq], context_len)
        q = query[begin:end].float().transpose(0, 1)  # [Hq, L, D]
        k = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, ctx, D]
        v = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        positions = torch.arange(context_len - (end - begin), context_len, device=query.device)
        allowed = torch.arange(context_len, device=query.device)[None, :] <= positions[:, None]
        scores = (q @ k.transpose(1, 2)) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[begin:end] = (probs @ v).transpose(0, 1).to(query.dtype)
    return out


def _cache_append_cpu(key, value, key_cache, value_cache, slot_mapping):
    if INTERPRET:
        cache_append_launch(key, value, key_cache, value_cache, slot_mapping)
    else:
        cache_append_cpu(key, value, key_cache, value_cache, slot_mapping)


def _paged_attention_cuda(query, key_cache, value_cache, block_tables, context_lens, scale=None,
                          max_context_len=None):
    return paged_decode_launch(query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len)


def _paged_attention_cpu(query, key_cache, value_cache, block_tables, context_lens, scale=None,
                         max_context_len=None):
    if INTERPRET:
        return paged_decode_launch(query, key_cache, value_cache, block_tables, context_lens, scale,
                                   max_context_len)
    return paged_attention_cpu(query, key_cache, value_cache, block_tables, context_lens, scale)


def _paged_decode_append_cuda(query, key, value, key_cache, value_cache, slot_mapping, block_tables, context_lens,
                              scale=None, max_context_len=None):
    return paged_decode_append_launch(query, key, value, key_cache, value_cache, slot_mapping, block_tables,
                                      context_lens, scale, max_context_len)


def _paged_decode_append_cpu(query, key, value, key_cache, value_cache, slot_mapping, block_tables, context_lens,
                             scale=None, max_context_len=None):
    if INTERPRET:
        return paged_decode_append_launch(query, key, value, key_cache, value_cache, slot_mapping, block_tables,
                                          context_lens, scale, max_context_len)
    _, group, _, _ = check_decode_append_inputs(query, key, value, key_cache, value_cache, slot_mapping,
                                                block_tables, context_lens)
    cache_append_cpu(key, value, key_cache, value_cache, slot_mapping)
    rows = slot_mapping >= 0
    if bool(rows.all()):
        return paged_attention_cpu(query, key_cache, value_cache, block_tables, context_lens, scale)
    # Padding rows (context 1, nothing appended) attend to their own token only: their output is its value.
    out = value.repeat_interleave(group, dim=1)
    if bool(rows.any()):
        out[rows] = paged_attention_cpu(query[rows], key_cache, value_cache, block_tables[rows], context_lens[rows],
                                        scale)
    return out


def _paged_prefill_cuda(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale=None,
                        max_query_len=None):
    return paged_prefill_launch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                                max_query_len)


def _paged_prefill_cpu(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale=None,
                       max_query_len=None):
    if INTERPRET:
        return paged_prefill_launch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                                    scale, max_query_len)
    return paged_prefill_torch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale)


LIB.impl("cache_append_gpu", cache_append_launch, "CUDA")
LIB.impl("cache_append_gpu", _cache_append_cpu, "CPU")
LIB.impl("paged_attention_gpu", _paged_attention_cuda, "CUDA")
LIB.impl("paged_attention_gpu", _paged_attention_cpu, "CPU")
LIB.impl("paged_decode_append_gpu", _paged_decode_append_cuda, "CUDA")
LIB.impl("paged_decode_append_gpu", _paged_decode_append_cpu, "CPU")
LIB.impl("paged_prefill_attention_gpu", _paged_prefill_cuda, "CUDA")
LIB.impl("paged_prefill_attention_gpu", _paged_prefill_cpu, "CPU")
no_autograd_formula("paged_attention_gpu")
no_autograd_formula("paged_prefill_attention_gpu")


def cache_append_gpu(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_dim] (may be strided) into the caches at slot_mapping
    (int64 [num_tokens], slot = block_id * block_size + offset); negative slots are skipped (padding)."""
    torch.ops.apex.cache_append_gpu(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_gpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: Optional[float] = None,
                        max_context_len: Optional[int] = None) -> torch.Tensor:
    """Decode attention of query [num_seqs, num_heads, head_dim] (may be strided) over each sequence's cached
    tokens: block_tables int32 [num_seqs, max_blocks], context_lens int32 [num_seqs] (>= 1, counting the
    current token). Returns [num_seqs, num_heads, head_dim] in the query's (= the cache's) dtype; scale defaults
    to head_dim ** -0.5. `max_context_len`, a host-side upper bound of context_lens, only tunes the split-K
    choice (default: the block-table capacity); results never depend on it. Block ids a sequence reads outside
    [0, num_blocks) raise IndexError (checked with one device synchronisation).
    """
    check_block_ids(block_tables, context_lens, key_cache.shape[0], key_cache.shape[2])
    return torch.ops.apex.paged_attention_gpu(query, key_cache, value_cache, block_tables, context_lens, scale,
                                              max_context_len)


def paged_decode_append_gpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: Optional[float] = None,
                            max_context_len: Optional[int] = None) -> torch.Tensor:
    """`cache_append_gpu(key, value, key_cache, value_cache, slot_mapping)` then `paged_attention_gpu(query,
    key_cache, value_cache, block_tables, context_lens, scale, max_context_len)`, in one kernel on CUDA.

    Decode rows: query [num_seqs, num_heads, head_dim] and key/value [num_seqs, num_kv_heads, head_dim] (may be
    strided views, e.g. slices of one QKV output), in the cache's dtype; slot_mapping int64 [num_seqs].
    Row s's current token is position context_lens[s] - 1, and slot_mapping[s] must be its slot in
    block_tables[s], or -1 in a padding row of context 1 (nothing is written; its output is its own value rows).
    Returns [num_seqs, num_heads, head_dim]. Block ids a sequence reads outside [0, num_blocks) raise IndexError
    (checked with one device synchronisation); on CPU tensors, slots that break the rule above raise ValueError.
    """
    check_block_ids(block_tables, context_lens, key_cache.shape[0], key_cache.shape[2])
    return torch.ops.apex.paged_decode_append_gpu(query, key, value, key_cache, value_cache, slot_mapping,
                                                  block_tables, context_lens, scale, max_context_len)


def paged_prefill_attention_gpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: Optional[float] = None,
                                max_query_len: Optional[int] = None) -> torch.Tensor:
    """Causal attention of packed queries [T, num_heads, head_dim] over the paged cache.

    query_start_loc int32 [num_seqs + 1] (rows of sequence s: query_start_loc[s]:query_start_loc[s+1]);
    context_lens int32 [num_seqs] count every cached token including this chunk (append K/V first); each
    chunk is the last tokens of its context. Returns [T, num_heads, head_dim] in the query's dtype.
    `max_query_len` (host int, >= the longest chunk) avoids a device sync; computed from query_start_loc if
    omitted. Block ids a sequence reads outside [0, num_blocks) raise IndexError (one device synchronisation).
    """
    check_block_ids(block_tables, context_lens, key_cache.shape[0], key_cache.shape[2])
    return torch.ops.apex.paged_prefill_attention_gpu(query, key_cache, value_cache, block_tables,
                                                      query_start_loc, context_lens, scale, max_query_len)

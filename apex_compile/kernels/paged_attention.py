"""GPU paged KV cache: allocation and the Triton kernels of KV append and decode attention (launched by the ops
`apex::cache_append_gpu`, `apex::paged_attention_gpu` and `apex::paged_decode_append_gpu`, defined in
apex_compile.ops.gpu_attention).

Cache layout (notes/CONVENTIONS.md, identical to the CPU pool): key_cache and value_cache are contiguous
`[num_blocks, num_kv_heads, block_size, head_dim]`; V is stored as that shape; inside each (block, kv_head)
slab K element (token t, dim d) is at `((t // 16) * head_dim + d) * 16 + t % 16` (16-token panels,
dim-major), so a `[head_dim, 16*k]` tile of K^T from one block is contiguous memory.

Decode kernel (`_paged_decode_kernel`), grid (num_seqs, num_kv_heads, num_splits):
- one program handles all `group = num_heads / num_kv_heads` query heads of its kv head, so each K/V byte is
  loaded once per step: the scores of a chunk are one `tl.dot([group (padded to 16), D] x [D, BLOCK_T])`;
- chunks of BLOCK_T tokens may span cache blocks (each token looks up its block; tokens of one 16-panel
  share it), so the chunk size does not depend on block_size;
- loads are unmasked along tokens (tail tokens of the last block are read and discarded: their scores become
  -inf and their V rows are zeroed), which keeps them vectorised; block-table lookups are clamped to the
  context, so only blocks of the sequence are touched; whole chunks skip the masking, only a range's last
  partial chunk is masked (`attend_chunk`, shared with the prefill kernel);
- online softmax in base 2 with fp32 statistics and accumulator;
- split-K over long contexts: when num_seqs * num_kv_heads programs cannot fill the GPU, each sequence's
  tokens are split into ranges. A sequence whose context fills one range writes its output directly; else
  each of its non-empty splits writes its normalised partial output and log-sum-exp and increments a
  per-(sequence, kv head) counter, and the split that arrives last merges the partials and resets the counter
  to zero (`reserve_decode_counters`: the persistent counters). Where no large enough counters exist during a
  CUDA graph capture, `_paged_decode_merge_kernel` merges instead, as a second launch.
- fused append (`apex::paged_decode_append_gpu`, FUSED_APPEND): the current token of each row (position
  context_len - 1) is not read from the cache but folded in from the key/value rows by the split whose range
  ends at the context, which also stores it into the cache at its slot: one launch replaces
  `cache_append_gpu` + decode.
The number of splits depends only on shapes and an optional host-side `max_context_len` (no device sync); each
sequence divides its own context over them (a short one uses fewer), so a launch planned for the block table's
capacity, as a CUDA graph is, still spreads every context over the GPU.

On CUDA, data-dependent checks are not made (they would synchronise): a zero context gives NaN rows, and
cache_append_gpu ignores slots outside [0, num_blocks * block_size). On CPU tensors (interpreter) both raise.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from apex_compile.kernels._common import (
    UPCAST_DOT_OPERANDS,
    cdiv,
    check_float_dtype,
    check_same_device,
    dot_precision,
    next_pow2,
    sm_count,
)

LOG2E = 1.4426950408889634
DECODE_BLOCK_T = 64
"""Tokens per inner-loop chunk of the decode kernel when the grid has many programs (and the fallback)."""
DECODE_BLOCK_T_SMALL_GRID = 128
"""Chunk for grids of at most one program per SMALL_GRID_SMS_PER_PROGRAM SMs, when its K/V tiles are at most
SMALL_GRID_TILE_BYTES: fewer, larger loads per program where the grid leaves SMs free (`benchmarks/triton_sweep.py`)."""
SMALL_GRID_TILE_BYTES = 32 * 1024
DECODE_NUM_STAGES = 2
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 128
PROGRAMS_PER_SM = 4
"""Decode programs per SM that split-K fills with chunks of DECODE_BLOCK_T (bf16, head_dim 128, 4 warps: 128
registers per thread and ~55 KB of shared memory each are resident together); with the larger chunk, 2."""
SMALL_GRID_SMS_PER_PROGRAM = 2
"""Two 128-token chunk stages take ~128 KB of shared memory (one resident program per SM): beyond half an SM per
program the 64-token chunk, three resident per SM, wins (the 128-token chunk leaves SMs idle at such grids)."""


@triton.jit
def _cache_append_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head, num_slots,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    in_range = (slot >= 0) & (slot < num_slots)
    slot = tl.where(in_range, slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < tl.where(in_range, NUM_KV_HEADS, 0))[:, None] & (offs_d < HEAD_DIM)[None, :]
    key = tl.load(key_ptr + token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :],
                  mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + offs_h[:, None] * stride_value_head + offs_d[None, :],
                    mask=mask)
    slabs = (block * NUM_KV_HEADS + offs_h) * (BLOCK_SIZE * HEAD_DIM)
    key_offsets = (slabs + (offset // 16) * (16 * HEAD_DIM) + offset % 16)[:, None] + offs_d[None, :] * 16
    tl.store(key_cache_ptr + key_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value_offsets = (slabs + offset * HEAD_DIM)[:, None] + offs_d[None, :]
    tl.store(value_cache_ptr + value_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def attend_chunk(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_row, chunk_start, context_len, kv_head, scale_log2e,
    row_limit, token_limit, k_tile, v_tile,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) by the BLOCK_T cached tokens from chunk_start (a multiple of 16).

    q: [rows, BLOCK_D] in the cache dtype. With MASKED, row r sees tokens <= row_limit[r] and tokens >=
    token_limit contribute nothing (their cache slots may hold garbage); without it every token of the chunk is
    visible to every row (the caller guarantees it). k_tile / v_tile: the chunk-independent parts of the K^T
    [BLOCK_D, BLOCK_T] and V [BLOCK_T, BLOCK_D] tile offsets (see `_paged_decode_kernel`).
    """
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tokens = chunk_start + offs_t
    # Clamping to the last context token keeps each aligned 16-token panel on one block (block_size >= 16)
    # and never reads block-table entries past the context.
    block_ids = tl.load(block_table_row + tl.minimum(tokens, context_len - 1) // BLOCK_SIZE)
    block_ids = tl.max_constancy(block_ids, [16])
    slab = (block_ids.to(tl.int64) * NUM_KV_HEADS + kv_head) * (BLOCK_SIZE * HEAD_DIM)
    in_block = tokens % BLOCK_SIZE
    k_offsets = (slab + (in_block // 16) * (16 * HEAD_DIM))[None, :] + k_tile
    k_offsets = tl.max_contiguous(tl.multiple_of(k_offsets, [1, 16]), [1, 16])
    if BLOCK_D == HEAD_DIM:
        k = tl.load(k_cache_ptr + k_offsets)
    else:
        k = tl.load(k_cache_ptr + k_offsets, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2e
    if MASKED:
        scores = tl.where(tokens[None, :] <= row_limit[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_offsets = (slab + in_block * HEAD_DIM)[:, None] + v_tile
    if BLOCK_D == HEAD_DIM:
        v = tl.load(v_cache_ptr + v_offsets)
    else:
        v = tl.load(v_cache_ptr + v_offsets, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    if MASKED:
        v = tl.where((tokens < token_limit)[:, None], v, 0.0)  # p = 0 there, but 0 * NaN would be NaN
    p = p.to(v_cache_ptr.dtype.element_ty)
    if UPCAST_DOT:
        v = v.to(tl.float32)
        p = p.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_and_append_current_token(
    q, acc, m_i, l_i, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, seq64, kv_head, scale_log2e,
    stride_key_seq, stride_key_head, stride_value_seq, stride_value_head, num_slots,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) by the current token of row seq64, from its key/value rows (not
    the cache), and the store of that token's K (panel-transposed) and V into the caches at its slot (skipped
    for a slot outside [0, num_slots): padding rows)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    key = tl.load(key_ptr + seq64 * stride_key_seq + kv_head * stride_key_head + offs_d, mask=d_mask, other=0.0)
    value = tl.load(value_ptr + seq64 * stride_value_seq + kv_head * stride_value_head + offs_d, mask=d_mask,
                    other=0.0)
    key = key.to(k_cache_ptr.dtype.element_ty)
    value = value.to(v_cache_ptr.dtype.element_ty)
    # One score per query head of the group: a row reduction (a single token needs no tensor-core dot).
    scores = tl.sum(q.to(tl.float32) * key.to(tl.float32)[None, :], axis=1) * scale_log2e
    m_new = tl.maximum(m_i, scores)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new)
    l_i = l_i * alpha + p
    p = p.to(v_cache_ptr.dtype.element_ty).to(tl.float32)  # rounded as attend_chunk rounds its P operand
    acc = acc * alpha[:, None] + p[:, None] * value.to(tl.float32)[None, :]

    slot = tl.load(slot_ptr + seq64).to(tl.int64)
    in_range = (slot >= 0) & (slot < num_slots)
    slot = tl.where(in_range, slot, 0)
    offset = slot % BLOCK_SIZE
    slab = ((slot // BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * (BLOCK_SIZE * HEAD_DIM)
    store_mask = offs_d < tl.where(in_range, HEAD_DIM, 0)
    tl.store(k_cache_ptr + slab + (offset // 16) * (16 * HEAD_DIM) + offset % 16 + offs_d * 16, key,
             mask=store_mask)
    tl.store(v_cache_ptr + slab + offset * HEAD_DIM + offs_d, value, mask=store_mask)
    return acc, m_new, l_i


@triton.jit
def _merge_partials(part_out_ptr, part_lse_ptr, part_rows, num_parts, g_mask, store_mask,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    """The output rows [BLOCK_G, BLOCK_D] merged from the first num_parts partials of part_rows (the partial of
    split s of row r at r + s): the weighted mean of `_paged_decode_merge_kernel`, accumulated split by split
    with a running maximum (no per-num_splits block size, so no recompilation). Loads bypass L1 (".cg"): the
    partials were stored by other programs."""
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for part in range(0, num_parts):
        lse = tl.load(part_lse_ptr + part_rows + part, mask=g_mask, other=0.0, cache_modifier=".cg")
        out = tl.load(part_out_ptr + (part_rows + part)[:, None] * HEAD_DIM + offs_d[None, :], mask=store_mask,
                      other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + out * weight[:, None]
        weight_sum = weight_sum * alpha + weight
        m = m_new
    return acc / weight_sum[:, None]


@triton.jit
def _store_partial(part_out_ptr, part_lse_ptr, part_rows, acc, m_i, l_i, g_mask, store_mask,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Stores one split's normalised partial output (fp32) and its log-sum-exp (base 2) at part_rows."""
    offs_d = tl.arange(0, BLOCK_D)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_mask)
    # l_i >= 1 after any token; an empty split stores m_i = -inf (the max only avoids log2(0)).
    tl.store(part_lse_ptr + part_rows, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=g_mask)


@triton.jit(do_not_specialize=["stride_block_tables", "max_blocks_per_seq", "num_splits", "tokens_per_split"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counters_ptr, key_ptr, value_ptr, slot_ptr,
    scale_log2e, stride_q_seq, stride_q_head, stride_key_seq, stride_key_head, stride_value_seq, stride_value_head,
    stride_block_tables, max_blocks_per_seq, num_slots, num_splits, tokens_per_split,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr, FUSED_APPEND: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)

    context_len = tl.load(context_lens_ptr + seq)
    context_len = tl.minimum(context_len, max_blocks_per_seq * BLOCK_SIZE)
    if tokens_per_split == 0:
        # Per-sequence split size (the host plan's rule on this sequence's own context): a ragged batch, or a
        # launch planned for the table's capacity (CUDA graphs), spreads each context over the splits.
        used_splits = tl.maximum(tl.minimum(num_splits, tl.cdiv(context_len, MIN_SPLIT_TOKENS)), 1)
        tokens_per_split = tl.cdiv(tl.cdiv(context_len, used_splits), BLOCK_T) * BLOCK_T
    # Splits 0..used-1 hold this sequence's tokens, split used-1 the last one; later ranges are empty.
    used = tl.maximum(tl.minimum(tl.cdiv(context_len, tl.maximum(tokens_per_split, 1)), num_splits), 1)
    if MERGE_IN_KERNEL:
        if split >= used:
            return  # an empty range: the merge reads only the used splits' partials
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)
    end = tl.where(split == num_splits - 1, context_len, end)  # the last split covers any remainder
    cache_end = end
    if FUSED_APPEND:
        cache_end = tl.minimum(end, context_len - 1)  # the current token comes from key/value, not the cache

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq64 * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq64 * stride_block_tables
    k_tile = offs_d[:, None] * 16 + (offs_t % 16)[None, :]
    v_tile = offs_d[None, :]
    row_limit = tl.zeros([BLOCK_G], dtype=tl.int32) + (cache_end - 1)
    # Whole chunks need no masking; only the last, partial chunk of the range does. With FUSED_APPEND the
    # unmasked tail loads of that chunk may read the slot of position context_len - 1 while this launch writes
    # it: harmless only because tail tokens are masked (score -inf, V zeroed by tl.where in attend_chunk).
    full_end = start + tl.maximum(cache_end - start, 0) // BLOCK_T * BLOCK_T
    for chunk_start in range(start, full_end, BLOCK_T):
        acc, m_i, l_i = attend_chunk(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_row, chunk_start, context_len, kv_head,
            scale_log2e, row_limit, cache_end, k_tile, v_tile, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
            BLOCK_T, False, DOT_PRECISION, UPCAST_DOT)
    for chunk_start in range(full_end, cache_end, BLOCK_T):
        acc, m_i, l_i = attend_chunk(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_row, chunk_start, context_len, kv_head,
            scale_log2e, row_limit, cache_end, k_tile, v_tile, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
            BLOCK_T, True, DOT_PRECISION, UPCAST_DOT)
    if FUSED_APPEND:
        if split == used - 1:
            acc, m_i, l_i = _attend_and_append_current_token(
                q, acc, m_i, l_i, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, seq64, kv_head,
                scale_log2e, stride_key_seq, stride_key_head, stride_value_seq, stride_value_head, num_slots,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_SIZE)

    num_heads = NUM_KV_HEADS * GROUP
    rows = seq64 * num_heads + heads
    store_mask = g_mask[:, None] & d_mask[None, :]
    out_offsets = rows[:, None] * HEAD_DIM + offs_d[None, :]
    part_rows = rows * num_splits
    if SINGLE_SPLIT:
        out = acc / l_i[:, None]  # a zero context gives 0/0 = NaN rows
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    elif MERGE_IN_KERNEL:
        if used == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            _store_partial(part_out_ptr, part_lse_ptr, part_rows + split, acc, m_i, l_i, g_mask, store_mask,
                           HEAD_DIM, BLOCK_D)
            # The last split to arrive merges (the CUTLASS semaphore pattern: bar.sync, then one thread's
            # gpu-scope release; one thread's acquire, then bar.sync). One thread issues the atomic: the barrier
            # before it puts every thread's partial stores ahead of its release half (Triton releases before
            # triton-lang/triton#10816 insert none themselves), its acquire half sees the partials the other
            # splits released, and the barrier after it puts every thread's merge loads behind that acquire.
            tl.debug_barrier()
            counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == used - 1:
                tl.debug_barrier()
                tl.store(counter, 0)  # every split has arrived: zero for the next launch or graph replay
                out = _merge_partials(part_out_ptr, part_lse_ptr, part_rows, used, g_mask, store_mask,
                                      HEAD_DIM, BLOCK_D, BLOCK_G)
                tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        _store_partial(part_out_ptr, part_lse_ptr, part_rows + split, acc, m_i, l_i, g_mask, store_mask,
                       HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # empty splits weigh 0; all empty (zero context): NaN
    parts = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------------------------------------
# Host side


def check_cache_geometry(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validates a K/V cache pair; returns (num_blocks, num_kv_heads, block_size, head_dim)."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, num_kv_heads, block_size, head_dim], got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(f"key_cache {key_cache.dtype} and value_cache {value_cache.dtype} differ")
    check_float_dtype("key_cache", key_cache)
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    check_block_geometry(block_size, head_dim)
    return num_blocks, num_kv_heads, block_size, head_dim


def check_block_geometry(block_size: int, head_dim: int) -> None:
    """Raises unless block_size is a power of two in 16..256 and head_dim a multiple of 16 in 16..256."""
    if block_size < 16 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 16..256, got {block_size}")
    if head_dim < 16 or head_dim > 256 or head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 in 16..256, got {head_dim}")


def allocate_kv_cache_gpu(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                          device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns uninitialised (key_cache, value_cache), each [num_blocks, num_kv_heads, block_size, head_dim].

    Only tokens written by `cache_append_gpu` (or copied in with `copy_blocks`) are used by the kernels.
    `device` may be "cpu" for the kernels under TRITON_INTERPRET=1.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"KV cache dtype must be float32, bfloat16 or float16, got {dtype}")
    if num_blocks < 1 or num_kv_heads < 1:
        raise ValueError(f"num_blocks and num_kv_heads must be >= 1, got {num_blocks}, {num_kv_heads}")
    check_block_geometry(block_size, head_dim)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    return (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))


def _check_append_inputs(key, value, key_cache, value_cache, slot_mapping):
    num_blocks, num_kv_heads, block_size, head_dim = check_cache_geometry(key_cache, value_cache)
    if key.dim() != 3 or key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key/value must be [num_tokens, {num_kv_heads}, {head_dim}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    if not slot_mapping.is_cuda and slot_mapping.numel() and int(slot_mapping.max()) >= num_blocks * block_size:
        raise IndexError(f"slot_mapping has a slot >= {num_blocks * block_size} (num_blocks * block_size)")
    return num_blocks, num_kv_heads, block_size, head_dim


def trusted_geometry(query: torch.Tensor, key_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_kv_heads, group, block_size, head_dim) from shapes alone: the launchers' `check=False` path, for a
    caller that builds its inputs (the engine's runner on CUDA, where a mixed step launches these per layer
    from Python and the checks were ~12% of its launching thread's time under cProfile)."""
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    return num_kv_heads, query.shape[1] // num_kv_heads, block_size, head_dim


def cache_append_launch(key, value, key_cache, value_cache, slot_mapping, check: bool = True) -> None:
    """Triton scatter of key/value [num_tokens, num_kv_heads, head_dim] into the caches (negative slots skipped);
    check=False skips the validation (`trusted_geometry`)."""
    if check:
        num_blocks, num_kv_heads, block_size, head_dim = _check_append_inputs(
            key, value, key_cache, value_cache, slot_mapping)
    else:
        num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    if key.shape[0] == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _cache_append_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), num_blocks * block_size,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=max(2, next_pow2(num_kv_heads)),
        BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=block_size, num_warps=2,
    )


def check_attention_inputs(query, key_cache, value_cache, block_tables, context_lens):
    """Shared validation of the paged attention ops; returns (num_kv_heads, group, block_size, head_dim)."""
    _, num_kv_heads, block_size, head_dim = check_cache_geometry(key_cache, value_cache)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [*, num_heads, {head_dim}], got {tuple(query.shape)}")
    if query.dtype != key_cache.dtype:
        raise TypeError(f"query dtype {query.dtype} must equal the cache dtype {key_cache.dtype}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [num_seqs, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if context_lens.dim() != 1 or context_lens.dtype != torch.int32 or context_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"context_lens must be int32 [{block_tables.shape[0]}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                      context_lens=context_lens)
    if not context_lens.is_cuda and context_lens.numel():
        if int(context_lens.min()) < 1:
            raise ValueError("context_lens must be >= 1 (the current token is already appended)")
        if int(context_lens.max()) > block_tables.shape[1] * block_size:
            raise ValueError(f"a context is longer than its block table ({block_tables.shape[1]} blocks)")
    return num_kv_heads, query.shape[1] // num_kv_heads, block_size, head_dim


def check_block_ids(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raises IndexError unless every block id a sequence reads (the first cdiv(context_len, block_size) entries
    of its row) is in [0, num_blocks). One min/max reduction, so one device synchronisation on CUDA: the public
    ops call it; the engine, which builds its own tables, calls the ops unchecked. Skipped while a CUDA graph is
    being captured (a capture cannot synchronise; the captured tables are the caller's to keep valid)."""
    if block_tables.numel() == 0 or context_lens.numel() == 0:
        return
    if block_tables.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    used = (context_lens.to(torch.int64).clamp(min=0) + block_size - 1) // block_size
    read = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < used[:, None]
    lowest = torch.where(read, block_tables, 0).min()
    highest = torch.where(read, block_tables, 0).max()
    lowest, highest = torch.stack([lowest, highest]).tolist()
    if lowest < 0 or highest >= num_blocks:
        bad = lowest if lowest < 0 else highest
        raise IndexError(f"block_tables holds block id {bad} where the sequence reads it: ids must be in "
                         f"[0, {num_blocks}) for a cache of {num_blocks} blocks")


def decode_split_plan(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      block_t: int = DECODE_BLOCK_T, programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode launch, from shapes only (no device synchronisation).

    Splits are added while num_seqs * num_kv_heads * num_splits programs fit in one wave of `programs_per_sm`
    resident programs per SM (a partly filled second wave would leave most SMs idle at the end), and none is
    shorter than MIN_TOKENS_PER_SPLIT tokens.
    """
    programs = max(1, num_seqs * num_kv_heads)
    context = max(max_context_len, 1)
    splits = max(1, min(programs_per_sm * sm_count(device) // programs, cdiv(context, MIN_TOKENS_PER_SPLIT),
                        MAX_SPLITS))
    tokens_per_split = cdiv(cdiv(context, splits), block_t) * block_t
    return cdiv(context, tokens_per_split), tokens_per_split


def decode_chunk(num_seqs: int, num_kv_heads: int, head_dim: int, element_size: int,
                 device: torch.device) -> tuple[int, int]:
    """(block_t, programs_per_sm) of a decode launch: DECODE_BLOCK_T_SMALL_GRID tokens per chunk and 2 programs
    per SM for split-K when num_seqs * num_kv_heads programs leave at least half of the SMs empty and the
    chunk's K/V tiles fit SMALL_GRID_TILE_BYTES; else DECODE_BLOCK_T and PROGRAMS_PER_SM."""
    small_grid = num_seqs * num_kv_heads * SMALL_GRID_SMS_PER_PROGRAM <= sm_count(device)
    if small_grid and DECODE_BLOCK_T_SMALL_GRID * head_dim * element_size <= SMALL_GRID_TILE_BYTES:
        return DECODE_BLOCK_T_SMALL_GRID, 2
    return DECODE_BLOCK_T, PROGRAMS_PER_SM


_merge_counters: dict = {}
"""torch.device -> the device's zeroed int32 split-arrival counters (see `reserve_decode_counters`)."""
_retired_merge_counters: list = []
"""Counters replaced by larger ones, kept alive: CUDA graphs captured with them hold their addresses."""


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _counter_device(device) -> torch.device:
    """`device` with its index (the key of `_merge_counters`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def reserve_decode_counters(device, count: int) -> torch.Tensor:
    """Returns the persistent zero-initialised int32 counters of `device` through which the splits of a decode
    launch find the last one to arrive (it merges their partials and resets its counter to zero), allocating or
    growing them to at least `count` (= num_seqs * num_kv_heads of the largest launch). Call it before capturing
    CUDA graphs: a launch captured with too few counters merges with a second kernel instead. Raises while a
    CUDA graph is being captured if the counters must grow (no allocation may happen then). Every decode launch
    on the device uses them from index 0, so two launches must not run at the same time (other streams)."""
    device = _counter_device(device)
    counters = _merge_counters.get(device)
    if counters is None or counters.numel() < count:
        if _capturing():
            raise RuntimeError("decode split counters cannot grow while a CUDA graph is being captured: call "
                               "reserve_decode_counters before the capture")
        if counters is not None:
            _retired_merge_counters.append(counters)
        counters = torch.zeros(next_pow2(max(count, 1)), dtype=torch.int32, device=device)
        _merge_counters[device] = counters
    return counters


def _counters_for_launch(device, count: int):
    """The device's counters, grown to `count` if needed; None when they are too small and a CUDA graph is being
    captured (the launch then merges with `_paged_decode_merge_kernel`)."""
    counters = _merge_counters.get(_counter_device(device))
    if counters is not None and counters.numel() >= count:
        return counters
    if _capturing():
        return None
    return reserve_decode_counters(device, count)


def check_decode_append_inputs(query, key, value, key_cache, value_cache, slot_mapping, block_tables,
                               context_lens):
    """Validation of the fused decode + append op (on top of `check_attention_inputs`); returns (num_kv_heads,
    group, block_size, head_dim). CPU tensors only: each slot must be that of position context_len - 1 in its
    row's block table, or negative in a padding row of context 1."""
    num_kv_heads, group, block_size, head_dim = check_attention_inputs(
        query, key_cache, value_cache, block_tables, context_lens)
    _check_append_inputs(key, value, key_cache, value_cache, slot_mapping)
    num_seqs = query.shape[0]
    if key.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query, key/value and block_tables must have one row per sequence, got "
                         f"{num_seqs}, {key.shape[0]} and {block_tables.shape[0]}")
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        raise TypeError(f"key/value dtypes {key.dtype}/{value.dtype} must equal the cache dtype {key_cache.dtype}")
    if not slot_mapping.is_cuda and num_seqs:
        last = context_lens.to(torch.int64) - 1
        table_blocks = block_tables.gather(1, (last // block_size)[:, None])[:, 0].to(torch.int64)
        expected = table_blocks * block_size + last % block_size
        padding = slot_mapping < 0
        if bool((padding & (context_lens != 1)).any()):
            raise ValueError("a row with a negative slot (padding) must have context length 1")
        if not bool(((slot_mapping == expected) | padding).all()):
            raise ValueError("slot_mapping[s] must be the slot of position context_lens[s] - 1 in block_tables[s]")
    return num_kv_heads, group, block_size, head_dim


def output_for(query: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """A launcher's output: `out` when given (checked: a contiguous tensor shaped and typed like query, on its
    device), else a new one."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {query.dtype} tensor of shape {tuple(query.shape)} on "
                         f"{query.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def paged_decode_launch(query, key_cache, value_cache, block_tables, context_lens, scale=None,
                        max_context_len=None, tokens_per_split=None, block_t=None,
                        num_warps=None, num_stages=DECODE_NUM_STAGES, merge_kernel=False, out=None,
                        check: bool = True) -> torch.Tensor:
    """Runs the Triton decode kernel; `tokens_per_split` / `block_t` force a split size / chunk, `merge_kernel`
    the separate merge launch (tests, benchmarks; default: `decode_chunk`, `decode_split_plan`, in-kernel
    merge); out: as `paged_decode_append_launch`'s; check=False skips the validation (`trusted_geometry`)."""
    geometry = (check_attention_inputs(query, key_cache, value_cache, block_tables, context_lens) if check
                else trusted_geometry(query, key_cache))
    return _decode_launch(query, None, key_cache, value_cache, block_tables, context_lens, geometry, scale,
                          max_context_len, tokens_per_split, block_t, num_warps, num_stages, merge_kernel, out)


def paged_decode_append_launch(query, key, value, key_cache, value_cache, slot_mapping, block_tables, context_lens,
                               scale=None, max_context_len=None, tokens_per_split=None, block_t=None,
                               num_warps=None, num_stages=DECODE_NUM_STAGES, merge_kernel=False,
                               out=None, check: bool = True) -> torch.Tensor:
    """`cache_append_launch` of each row's current token (key/value [num_seqs, num_kv_heads, head_dim] at
    slot_mapping) followed by `paged_decode_launch`, in one Triton launch (same options). out: a contiguous
    tensor shaped and typed like query to write the result into (e.g. rows of a larger output; default new);
    check=False skips the validation (`trusted_geometry`)."""
    geometry = (check_decode_append_inputs(query, key, value, key_cache, value_cache, slot_mapping, block_tables,
                                           context_lens) if check else trusted_geometry(query, key_cache))
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    return _decode_launch(query, (key, value, slot_mapping), key_cache, value_cache, block_tables, context_lens,
                          geometry, scale, max_context_len, tokens_per_split, block_t, num_warps, num_stages,
                          merge_kernel, out)


def _decode_launch(query, current, key_cache, value_cache, block_tables, context_lens, geometry, scale,
                   max_context_len, tokens_per_split, block_t, num_warps, num_stages, merge_kernel, out=None):
    """The decode launch of validated inputs; `current`: None, or the (key, value, slot_mapping) to append."""
    num_kv_heads, group, block_size, head_dim = geometry
    num_seqs, num_heads = query.shape[0], query.shape[1]
    out = output_for(query, out)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    capacity = block_tables.shape[1] * block_size
    programs_per_sm = PROGRAMS_PER_SM
    if block_t is None:
        block_t, programs_per_sm = decode_chunk(num_seqs, num_kv_heads, head_dim, key_cache.element_size(),
                                                query.device)
        if tokens_per_split is not None and tokens_per_split % block_t:
            block_t = DECODE_BLOCK_T
    if tokens_per_split is None:
        num_splits, _ = decode_split_plan(
            num_seqs, num_kv_heads, min(max_context_len or capacity, capacity), query.device, block_t,
            programs_per_sm)
        tokens_per_split = 0  # each sequence splits its own context (kernel), up to num_splits ranges
    else:
        if tokens_per_split % block_t:
            raise ValueError(f"tokens_per_split must be a multiple of {block_t}")
        num_splits = cdiv(capacity, tokens_per_split)
    scale = head_dim ** -0.5 if scale is None else scale
    single = num_splits == 1
    counters = None
    if single:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        if not merge_kernel:
            counters = _counters_for_launch(query.device, num_seqs * num_kv_heads)
    merge_in_kernel = counters is not None
    if current is None:
        key, value, slot_mapping, num_slots = query, query, context_lens, 0  # unused
    else:
        key, value, slot_mapping = current
        num_slots = key_cache.shape[0] * block_size
    block_d = next_pow2(head_dim)
    num_warps = num_warps or (4 if head_dim <= 128 else 8)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, context_lens, out, part_out, part_lse,
        context_lens if counters is None else counters, key, value, slot_mapping,
        scale * LOG2E, query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), block_tables.stride(0), block_tables.shape[1], num_slots, num_splits, tokens_per_split,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_SIZE=block_size, BLOCK_T=block_t, SINGLE_SPLIT=single,
        MERGE_IN_KERNEL=merge_in_kernel, FUSED_APPEND=current is not None,
        DOT_PRECISION=dot_precision(key_cache.dtype), UPCAST_DOT=UPCAST_DOT_OPERANDS,
        MIN_SPLIT_TOKENS=MIN_TOKENS_PER_SPLIT, num_warps=num_warps, num_stages=num_stages,
    )
    if not single and not merge_in_kernel:
        _paged_decode_merge_kernel[(num_seqs * num_heads,)](
            part_out, part_lse, out, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(num_splits),
            num_warps=4,
        )
    return out

"""Triton kernel of causal prefill attention over packed variable-length prompts, read from the paged KV cache
(launched by the op `apex::paged_prefill_attention_gpu`, defined in apex_compile.ops.gpu_attention).

Sequence s owns query rows `query_start_loc[s] : query_start_loc[s + 1]` of the packed `query [T, Hq, D]`
(rows no sequence owns are left as they are in the output; a sequence may be empty); those are the last
`q_len` tokens of its `context_lens[s]` cached tokens (append them with cache_append_gpu first). Query i of
the chunk sits at position `context_len - q_len + i` and attends to cached tokens 0..position. This covers
whole prompts (q_len == context_len), chunked prefill and cached prefixes (q_len < context_len), and decode
rows (q_len == 1).

Kernel: flash-attention forward, grid (num_heads, query blocks, num_seqs); each program holds BLOCK_M query
rows of one head and walks the sequence's K/V in chunks of BLOCK_N tokens through the block table with the
decode kernel's chunk step (`attend_chunk`: panel-aware K^T loads, online softmax in base 2): unmasked for
chunks before the block's first position, causally masked up to the diagonal. Heads of one kv head are
adjacent programs, so their shared K/V tiles come from L2.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from apex_compile.kernels._common import UPCAST_DOT_OPERANDS, cdiv, dot_precision, next_pow2, sm_count
from apex_compile.kernels.paged_attention import (LOG2E, attend_chunk, check_attention_inputs, output_for,
                                                  trusted_geometry)


@triton.jit(do_not_specialize=["stride_block_tables", "max_blocks_per_seq", "num_q_blocks"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr, out_ptr,
    scale_log2e, stride_q_token, stride_q_head, stride_block_tables, max_blocks_per_seq, num_q_blocks,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    head = tl.program_id(0)
    q_block = num_q_blocks - 1 - tl.program_id(1)  # the longest (latest) query blocks start first
    seq = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    context_len = tl.minimum(tl.load(context_lens_ptr + seq), max_blocks_per_seq * BLOCK_SIZE)
    prefix = context_len - q_len

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_valid = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    positions = prefix + offs_m
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys up to the last valid row of this block; nothing for blocks past the end of the chunk.
    kv_end = tl.minimum(context_len, prefix + (q_block + 1) * BLOCK_M)
    kv_end = tl.where(q_block * BLOCK_M < q_len, kv_end, 0)
    # Chunks entirely at or before the block's first position are visible to every row: no masking.
    full_end = tl.minimum((prefix + q_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_tables
    k_tile = offs_d[:, None] * 16 + (offs_n % 16)[None, :]
    v_tile = offs_d[None, :]
    for chunk_start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_chunk(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_row, chunk_start, context_len, kv_head,
            scale_log2e, positions, context_len, k_tile, v_tile, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
            BLOCK_N, False, DOT_PRECISION, UPCAST_DOT)
    for chunk_start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_chunk(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_row, chunk_start, context_len, kv_head,
            scale_log2e, positions, context_len, k_tile, v_tile, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
            BLOCK_N, True, DOT_PRECISION, UPCAST_DOT)

    out = acc / l_i[:, None]
    out_rows = q_rows * (NUM_KV_HEADS * GROUP) + head
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_mask[None, :])


def default_prefill_config(head_dim: int, device: torch.device, tiles_128: Optional[int] = None) -> dict:
    """Tile sizes of the prefill kernel: 128-row query tiles on the GPU, small tiles under the interpreter.
    tiles_128: the launch's programs with 128-row tiles (heads x query blocks x sequences); under two per SM
    (a prompt chunk beside decode rows) 64-row tiles, which give twice the programs."""
    if device.type != "cuda":
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    if head_dim > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    # the best of the configs benchmarks/triton_kernels.py and benchmarks/mixed_attention.py tried on a Hopper GPU
    if tiles_128 is not None and tiles_128 < 2 * sm_count(device):
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}


def check_prefill_inputs(query, key_cache, value_cache, block_tables, query_start_loc, context_lens):
    """Shared validation of the prefill op; returns (num_kv_heads, group, block_size, head_dim)."""
    geometry = check_attention_inputs(query, key_cache, value_cache, block_tables, context_lens)
    num_seqs = block_tables.shape[0]
    if (query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32
            or query_start_loc.shape[0] != num_seqs + 1):
        raise ValueError(f"query_start_loc must be int32 [{num_seqs + 1}], got {query_start_loc.dtype} "
                         f"{tuple(query_start_loc.shape)}")
    if query_start_loc.device != query.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, query on {query.device}")
    if not query_start_loc.is_cuda:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        if int(query_start_loc[0]) < 0 or int(query_start_loc[-1]) > query.shape[0] or bool((q_lens < 0).any()):
            raise ValueError(f"query_start_loc must rise within 0..num_tokens={query.shape[0]}")
        if bool((q_lens > context_lens).any()):
            raise ValueError("a sequence has more query tokens than cached tokens (append K/V first)")
    return geometry


def paged_prefill_launch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale=None,
                         max_query_len=None, config: Optional[dict] = None, out=None,
                         check: bool = True) -> torch.Tensor:
    """Runs the Triton prefill kernel; `config` overrides the tile sizes (tests, benchmarks); out: a contiguous
    tensor shaped and typed like query to write into (default new); check=False skips the validation
    (`trusted_geometry`)."""
    num_kv_heads, group, block_size, head_dim = (
        check_prefill_inputs(query, key_cache, value_cache, block_tables, query_start_loc, context_lens) if check
        else trusted_geometry(query, key_cache))
    out = output_for(query, out)
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    config = config or default_prefill_config(head_dim, query.device,
                                              query.shape[1] * cdiv(max_query_len, 128) * num_seqs)
    num_q_blocks = cdiv(max_query_len, config["BLOCK_M"])
    if num_q_blocks == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else scale
    _paged_prefill_kernel[(query.shape[1], num_q_blocks, num_seqs)](
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out,
        scale * LOG2E, query.stride(0), query.stride(1), block_tables.stride(0), block_tables.shape[1],
        num_q_blocks,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        DOT_PRECISION=dot_precision(key_cache.dtype), UPCAST_DOT=UPCAST_DOT_OPERANDS,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out

"""Pure-torch helpers for the paged KV cache layout shared by the CPU and GPU pools (any device).

Caches are contiguous tensors of logical shape [num_blocks, num_kv_heads, block_size, head_dim]. V is stored
as that shape. K is stored, inside each (block, kv_head) slab of block_size * head_dim elements, in 16-token
panels transposed to dim-major order: element (token t, dim d) is at ((t // 16) * head_dim + d) * 16 + t % 16.
"""
from typing import Sequence, Tuple, Union

import torch

PANEL_TOKENS = 16

IdList = Union[torch.Tensor, Sequence[int]]


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table_row: IdList, context_len: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (k, v), each [context_len, num_kv_heads, head_dim], of one sequence in token order (copies)."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    context_len = int(context_len)
    used = -(-context_len // block_size)
    ids = torch.as_tensor(block_table_row, device=key_cache.device)[:used].long()
    panels = block_size // PANEL_TOKENS
    # K slab [panels, head_dim, 16] -> [panels, 16, head_dim] -> token-major [block_size, head_dim].
    k = key_cache.view(num_blocks, num_kv_heads, panels, head_dim, PANEL_TOKENS)[ids]
    k = k.transpose(3, 4).reshape(used, num_kv_heads, block_size, head_dim)
    v = value_cache[ids]
    k = k.permute(0, 2, 1, 3).reshape(used * block_size, num_kv_heads, head_dim)[:context_len]
    v = v.permute(0, 2, 1, 3).reshape(used * block_size, num_kv_heads, head_dim)[:context_len]
    return k, v


def _id_list(ids: IdList) -> list:
    return ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]


def copy_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: IdList, dst_ids: IdList) -> None:
    """Copies whole blocks src_cache[src_ids[i]] -> dst_cache[dst_ids[i]] (same block shape and dtype, any device
    pair). Across devices, runs of consecutive ids move as one slice each, asynchronously when the host side is
    pinned (synchronise the stream before reusing the source or reading the destination on the host)."""
    if src_cache.shape[1:] != dst_cache.shape[1:] or src_cache.dtype != dst_cache.dtype:
        raise ValueError(
            f"block shapes/dtypes differ: {tuple(src_cache.shape[1:])} {src_cache.dtype} vs "
            f"{tuple(dst_cache.shape[1:])} {dst_cache.dtype}"
        )
    src_list, dst_list = _id_list(src_ids), _id_list(dst_ids)
    if len(src_list) != len(dst_list):
        raise ValueError(f"src_ids and dst_ids differ in length: {len(src_list)} vs {len(dst_list)}")
    if not src_list:
        return
    for ids, cache, name in ((src_list, src_cache, "src_ids"), (dst_list, dst_cache, "dst_ids")):
        if min(ids) < 0 or max(ids) >= cache.shape[0]:
            raise IndexError(f"{name} out of range for a cache of {cache.shape[0]} blocks")
    if src_cache.device == dst_cache.device:
        index = torch.tensor(src_list, device=src_cache.device)
        dst_cache.index_copy_(0, torch.tensor(dst_list, device=dst_cache.device), src_cache.index_select(0, index))
        return
    host = src_cache if src_cache.device.type == "cpu" else dst_cache
    non_blocking = host.device.type == "cpu" and host.is_pinned()
    start = 0
    while start < len(src_list):
        end = start + 1
        while (
            end < len(src_list)
            and src_list[end] == src_list[end - 1] + 1
            and dst_list[end] == dst_list[end - 1] + 1
        ):
            end += 1
        s, d, n = src_list[start], dst_list[start], end - start
        dst_cache[d : d + n].copy_(src_cache[s : s + n], non_blocking=non_blocking)
        start = end

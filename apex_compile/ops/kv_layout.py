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
    pair); `copy_blocks_layers` of one cache pair."""
    copy_blocks_layers([src_cache], [dst_cache], src_ids, dst_ids)


def copy_blocks_layers(src_caches: Sequence[torch.Tensor], dst_caches: Sequence[torch.Tensor], src_ids: IdList,
                       dst_ids: IdList) -> None:
    """Copies blocks src_ids[i] -> dst_ids[i] of every cache pair (src_caches[l] -> dst_caches[l], e.g. each
    layer's K and V), the ids checked and their index tensors built once.

    Across devices the accelerator side gathers (or scatters) its blocks, wherever they lie in its pool, with
    one kernel per cache, and the host side moves one copy per run of consecutive host ids: a request crosses
    in a few large copies rather than one small copy per block and cache. Asynchronous when the host side is
    pinned (synchronise the stream before reusing the source or reading the destination on the host)."""
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source caches for {len(dst_caches)} destination caches")
    for src, dst in zip(src_caches, dst_caches):
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(f"block shapes/dtypes differ: {tuple(src.shape[1:])} {src.dtype} vs "
                             f"{tuple(dst.shape[1:])} {dst.dtype}")
    src_list, dst_list = _id_list(src_ids), _id_list(dst_ids)
    if len(src_list) != len(dst_list):
        raise ValueError(f"src_ids and dst_ids differ in length: {len(src_list)} vs {len(dst_list)}")
    if not src_list or not src_caches:
        return
    for ids, caches, name in ((src_list, src_caches, "src_ids"), (dst_list, dst_caches, "dst_ids")):
        blocks = min(c.shape[0] for c in caches)
        if min(ids) < 0 or max(ids) >= blocks:
            raise IndexError(f"{name} out of range for a cache of {blocks} blocks")
    src_device, dst_device = src_caches[0].device, dst_caches[0].device
    if src_device == dst_device:
        src_index = to_device(src_list, torch.int64, src_device)
        dst_index = to_device(dst_list, torch.int64, dst_device)
        for src, dst in zip(src_caches, dst_caches):
            dst.index_copy_(0, dst_index, src.index_select(0, src_index))
        return
    _copy_across(src_caches, dst_caches, src_list, dst_list, host_is_dst=dst_device.type == "cpu")


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(data)` on `device` without stalling the host: on CUDA through pinned staging memory and a
    non-blocking copy (torch's caching host allocator keeps the staging block until the copy has run). A copy
    from pageable memory would first wait for all the stream's queued work, e.g. the whole step's graph."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def id_runs(ids: list) -> list:
    """(position, first id, length) of each run of consecutive ids (in the given order)."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


def _copy_across(src_caches, dst_caches, src_list: list, dst_list: list, host_is_dst: bool) -> None:
    """`copy_blocks_layers` between the host and an accelerator (host_is_dst: which side the host is): a staging
    tensor of the blocks in order on the accelerator, filled or emptied there by one gather / scatter per cache,
    crossing in one copy per run of host ids. Works on any pair of devices (tested with both on the CPU)."""
    host_ids, device_ids = (dst_list, src_list) if host_is_dst else (src_list, dst_list)
    runs = id_runs(host_ids)
    device = (src_caches if host_is_dst else dst_caches)[0].device
    index = to_device(device_ids, torch.int64, device)
    for src, dst in zip(src_caches, dst_caches):
        host = dst if host_is_dst else src
        non_blocking = host.device.type == "cpu" and host.is_pinned()
        if host_is_dst:
            staged = src.index_select(0, index)
            for pos, first, n in runs:
                dst[first:first + n].copy_(staged[pos:pos + n], non_blocking=non_blocking)
        else:  # stream order keeps a later cache's staging (reusing this memory) behind this scatter
            staged = torch.empty((len(device_ids), *dst.shape[1:]), dtype=dst.dtype, device=device)
            for pos, first, n in runs:
                staged[pos:pos + n].copy_(src[first:first + n], non_blocking=non_blocking)
            dst.index_copy_(0, index, staged)

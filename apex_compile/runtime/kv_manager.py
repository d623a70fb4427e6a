"""Paged KV memory: a device pool and a host pool of KV blocks, per-request block tables, swaps between pools.

A request's KV lives in exactly one pool at a time. The cache layout is the same in both pools (see
notes/CONVENTIONS.md), so moving a request between pools is a plain copy of its blocks, layer by layer.
"""
import dataclasses
from typing import Dict, List, Optional

import torch

DEVICE_POOL = 0
HOST_POOL = 1
POOL_NAMES = ("device", "host")


class BlockAllocator:
    """Free list of block ids 0..num_blocks-1 of one pool."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    def allocate(self, count: int) -> List[int]:
        """Takes `count` free blocks; raises if fewer are free (callers check `num_free` first)."""
        if count > len(self._free):
            raise RuntimeError(f"block allocator: asked for {count} blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def free(self, block_ids: List[int]) -> None:
        """Returns blocks to the free list."""
        self._free.extend(reversed(block_ids))
        if len(self._free) > self.num_blocks:
            raise RuntimeError("block allocator: more blocks freed than allocated (double free)")


@dataclasses.dataclass
class CacheShape:
    """Shape and dtype of every layer's K and V cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * elem


class KVPool:
    """The per-layer K/V caches of one pool and its block allocator."""

    def __init__(self, index: int, shape: CacheShape, num_blocks: int, device: torch.device, pin_host: bool):
        from apex_compile.kernels.paged_attention import allocate_kv_cache_gpu
        from apex_compile.ops import allocate_kv_cache_cpu

        self.index = index
        self.name = POOL_NAMES[index]
        self.device = device
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.key_caches: List[torch.Tensor] = []
        self.value_caches: List[torch.Tensor] = []
        if num_blocks == 0:
            return
        for _ in range(shape.num_layers):
            if index == HOST_POOL:
                k, v = allocate_kv_cache_cpu(num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim,
                                             shape.dtype, pin_memory=pin_host)
            else:
                k, v = allocate_kv_cache_gpu(num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim,
                                             shape.dtype, device)
            self.key_caches.append(k)
            self.value_caches.append(v)


@dataclasses.dataclass
class BlockTable:
    """The blocks of one request, in token order, all in pool `pool`."""

    pool: int
    block_ids: List[int]


class KVManager:
    """Allocates blocks to requests in either pool, frees them, and moves whole requests between pools."""

    def __init__(self, shape: CacheShape, device_blocks: int, host_blocks: int, device: torch.device):
        self.shape = shape
        self.block_size = shape.block_size
        pin_host = device.type == "cuda"  # page-locked host pool: async swaps and staging copies
        self.pools = (KVPool(DEVICE_POOL, shape, device_blocks, device, pin_host),
                      KVPool(HOST_POOL, shape, host_blocks, torch.device("cpu"), pin_host))
        self.tables: Dict[int, BlockTable] = {}
        self._swap_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._swap_event: Optional[torch.cuda.Event] = None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_free(self, pool: int) -> int:
        """Free blocks of `pool`."""
        return self.pools[pool].allocator.num_free

    def pool_of(self, request_id: int) -> Optional[int]:
        """The pool holding the request's blocks, None when it holds none."""
        table = self.tables.get(request_id)
        return None if table is None else table.pool

    def extra_blocks(self, request_id: int, num_tokens: int) -> int:
        """How many more blocks the request needs so that its table covers `num_tokens` tokens."""
        table = self.tables.get(request_id)
        have = 0 if table is None else len(table.block_ids)
        return max(0, self.blocks_for(num_tokens) - have)

    def grow(self, request_id: int, pool: int, num_tokens: int) -> bool:
        """Extends the request's table in `pool` to cover `num_tokens`; False (nothing taken) if too few free."""
        table = self.tables.get(request_id)
        if table is not None and table.pool != pool:
            raise RuntimeError(
                f"request {request_id} lives in the {POOL_NAMES[table.pool]} pool, not {POOL_NAMES[pool]}")
        need = self.extra_blocks(request_id, num_tokens)
        if need > self.num_free(pool):
            return False
        if table is None:
            table = self.tables[request_id] = BlockTable(pool, [])
        table.block_ids.extend(self.pools[pool].allocator.allocate(need))
        return True

    def free(self, request_id: int) -> None:
        """Returns every block of the request (no-op when it holds none)."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pools[table.pool].allocator.free(table.block_ids)

    def can_move(self, request_id: int, dst_pool: int) -> bool:
        """Whether the destination pool has room for all the request's blocks."""
        table = self.tables[request_id]
        return table.pool != dst_pool and len(table.block_ids) <= self.num_free(dst_pool)

    def move(self, request_id: int, dst_pool: int) -> None:
        """Copies the request's blocks to `dst_pool` (every layer, K and V) and frees the source blocks.

        On CUDA the copies run on a side stream, overlapping the rest of the scheduling; `wait_for_moves`
        (called before the next forward) blocks until they are done, so freed source blocks are never
        overwritten early.
        """
        table = self.tables[request_id]
        if not self.can_move(request_id, dst_pool):
            raise RuntimeError(f"request {request_id}: no room to move it to the {POOL_NAMES[dst_pool]} pool")
        src, dst = self.pools[table.pool], self.pools[dst_pool]
        dst_ids = dst.allocator.allocate(len(table.block_ids))
        if self._swap_stream is not None:
            self._swap_stream.wait_stream(torch.cuda.current_stream(self._swap_stream.device))
            with torch.cuda.stream(self._swap_stream):
                self._copy_layers(src, dst, table.block_ids, dst_ids)
            self._swap_event = torch.cuda.Event()
            self._swap_event.record(self._swap_stream)
        else:
            self._copy_layers(src, dst, table.block_ids, dst_ids)
        src.allocator.free(table.block_ids)
        self.tables[request_id] = BlockTable(dst_pool, dst_ids)

    @staticmethod
    def _copy_layers(src: KVPool, dst: KVPool, src_ids: List[int], dst_ids: List[int]) -> None:
        from apex_compile.ops import copy_blocks

        src_t = torch.tensor(src_ids, dtype=torch.int64)
        dst_t = torch.tensor(dst_ids, dtype=torch.int64)
        for layer in range(len(src.key_caches)):
            copy_blocks(src.key_caches[layer], dst.key_caches[layer], src_t, dst_t)
            copy_blocks(src.value_caches[layer], dst.value_caches[layer], src_t, dst_t)

    def wait_for_moves(self) -> None:
        """Orders the compute stream (and host code) after every block move issued so far."""
        if self._swap_event is not None:
            self._swap_event.synchronize()
            self._swap_event = None

    def num_used(self, pool: int) -> int:
        """Blocks of `pool` held by requests."""
        return self.pools[pool].num_blocks - self.num_free(pool)

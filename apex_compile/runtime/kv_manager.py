"""Paged KV memory: a device pool and a host pool of KV blocks, per-request block tables, swaps between pools.

A request's KV lives in exactly one pool at a time. The cache layout is the same in both pools (see
notes/CONVENTIONS.md), so moving a request between pools is a plain copy of its blocks, layer by layer.
"""
import bisect
import ctypes
import dataclasses
import warnings
from typing import Callable, Dict, List, Optional

import torch

from apex_compile.ops.kv_layout import id_runs
from apex_compile.runtime.sampler import host_wait_event

DEVICE_POOL = 0
HOST_POOL = 1
POOL_NAMES = ("device", "host")
# On a device with a swap stream, block moves are ordered on the device and overlapped: the compute stream waits
# for a move only where the step reads or reuses its blocks; host code waits only where it touches moved host
# blocks; blocks a move frees return once it lands; the scheduler parks ahead so that a park's copy runs beside
# the next step (a host wait for every move would stall the launching thread behind each copy).


class BlockAllocator:
    """Free block ids 0..num_blocks-1 of one pool, kept as sorted runs of consecutive ids. A request takes the
    first run that holds all its blocks, else the longest runs first: few runs per request, so its move between
    pools crosses in few copies (the host side copies once per run and cache, `kv_layout._copy_across`, and a
    move's time grows with its runs)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._starts: List[int] = [0] if num_blocks else []  # sorted first ids of the free runs
        self._lengths: Dict[int, int] = {0: num_blocks} if num_blocks else {}  # run start -> its length
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return self._num_free

    @property
    def num_runs(self) -> int:
        """Runs of consecutive free ids (1 for an empty pool: how fragmented the free ids are)."""
        return len(self._starts)

    def allocate(self, count: int) -> List[int]:
        """Takes `count` free blocks, ascending within each run; raises if fewer are free (callers check
        `num_free` first)."""
        if count > self._num_free:
            raise RuntimeError(f"block allocator: asked for {count} blocks, {self._num_free} free")
        if count <= 0:
            return []
        start = next((s for s in self._starts if self._lengths[s] >= count), None)
        if start is not None:
            return self._take(start, count)
        taken: List[int] = []
        for start in sorted(self._starts, key=lambda s: -self._lengths[s]):
            taken += self._take(start, min(self._lengths[start], count - len(taken)))
            if len(taken) == count:
                return taken
        raise AssertionError("free runs and the free count disagree")

    def _take(self, start: int, count: int) -> List[int]:
        """The first `count` ids of the free run at `start`."""
        length = self._lengths.pop(start)
        index = bisect.bisect_left(self._starts, start)
        if count < length:
            self._starts[index] = start + count  # still before the next run
            self._lengths[start + count] = length - count
        else:
            del self._starts[index]
        self._num_free -= count
        return list(range(start, start + count))

    def free(self, block_ids: List[int]) -> None:
        """Returns blocks to the free runs (merged with their neighbours); raises, changing nothing, on a block
        already free or out of range."""
        if self._num_free + len(block_ids) > self.num_blocks:
            raise RuntimeError("block allocator: more blocks freed than allocated (double free)")
        runs = [(start, count) for _, start, count in id_runs(sorted(block_ids))]
        # a repeated id makes the next run start inside this one
        for (start, count), (after, _) in zip(runs, runs[1:] + [(None, 0)]):
            if after is not None and after < start + count or not self._is_held(start, count):
                raise RuntimeError(f"block allocator: blocks {start}..{start + count - 1} are free already or "
                                   f"out of range (double free)")
        for start, count in runs:
            self._insert(start, count)

    def _is_held(self, start: int, count: int) -> bool:
        """Whether ids start..start+count-1 are in range and in no free run."""
        if start < 0 or start + count > self.num_blocks:
            return False
        index = bisect.bisect_right(self._starts, start + count - 1)  # runs starting at or before the last id
        if not index:
            return True
        before = self._starts[index - 1]
        return before + self._lengths[before] <= start

    def _insert(self, start: int, count: int) -> None:
        """Adds the held run start..start+count-1 to the free runs, merged with adjacent ones."""
        index = bisect.bisect_left(self._starts, start)
        before = self._starts[index - 1] if index else None
        after = self._starts[index] if index < len(self._starts) else None
        self._num_free += count
        if after == start + count:  # merge with the run after
            count += self._lengths.pop(after)
            del self._starts[index]
        if before is not None and before + self._lengths[before] == start:  # and with the run before
            self._lengths[before] += count
        else:
            self._starts.insert(index, start)
            self._lengths[start] = count


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


def _cuda_status(result) -> int:
    return int(getattr(result, "value", result))


# host memory of registrations collected without `close`: unregistered at the next safe point (a new host pool,
# an explicit close), never in the collector, which may run while a CUDA graph is being captured
_UNRELEASED: List[List[torch.Tensor]] = []


def _clear_cuda_error() -> None:
    """cudaGetLastError through the libcudart torch loaded (torch's binding does not expose it), so that a refused
    registration is not reported by the next kernel launch's error check (best effort: a torch linked with a
    static runtime shows no libcudart here)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _unregister(tensors: List[torch.Tensor]) -> None:
    torch.cuda.synchronize()  # no copy still reads or writes the memory
    for tensor in tensors:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def release_unclosed() -> None:
    """Unregisters (and lets go) the host memory of registrations that were collected without `close`."""
    while _UNRELEASED:
        _unregister(_UNRELEASED.pop())


class HostRegistration:
    """Page-locks plain host tensors with cudaHostRegister, at their exact size: torch's pinned allocator rounds
    each allocation up to a power of two (a 40 GiB pool of 640 MiB layers would pin 64 GiB) and keeps freed
    blocks cached. `close` unregisters them, after the device's queued copies, while the tensors are still held
    here, so no registered memory is freed first; one collected without `close` is unregistered later
    (`release_unclosed`)."""

    def __init__(self):
        release_unclosed()
        self.tensors: List[torch.Tensor] = []
        self.refused = False  # the driver refused once: later layers are not tried

    def register(self, tensor: torch.Tensor) -> bool:
        """Page-locks `tensor`'s memory; False (nothing changed) when the driver refuses (a memlock limit)."""
        if self.refused:
            return False
        if _cuda_status(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)):
            _clear_cuda_error()
            self.refused = True
            return False
        self.tensors.append(tensor)
        return True

    def release(self, tensors: List[torch.Tensor]) -> None:
        """Unregisters these tensors (after the device's queued work) and lets them go."""
        if not tensors:
            return
        _unregister(tensors)
        ids = {id(t) for t in tensors}
        self.tensors = [t for t in self.tensors if id(t) not in ids]

    def close(self) -> None:
        self.release(list(self.tensors))
        release_unclosed()

    def __del__(self):
        if self.tensors:  # no CUDA call here (see _UNRELEASED): the memory stays held until then
            _UNRELEASED.append(self.tensors)


def _host_pinned_kv_cache(num_blocks: int, shape: "CacheShape", registration: HostRegistration):
    """A host layer's (key, value) cache, page-locked at its exact size (torch's pinned allocator if the
    driver refuses to register plain memory)."""
    from apex_compile.ops import allocate_kv_cache_cpu

    args = (num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim, shape.dtype)
    pair = allocate_kv_cache_cpu(*args)  # plain memory, huge pages advised (fewer TLB misses for the CPU op)
    registered = []
    for tensor in pair:
        if not registration.register(tensor):
            break
        registered.append(tensor)
    if len(registered) == len(pair):
        return pair
    registration.release(registered)
    del pair, registered
    warnings.warn("cudaHostRegister refused the host KV pool (memlock limit?): it is pinned by torch's "
                  "allocator instead, which rounds each layer's size up to a power of two", RuntimeWarning)
    return allocate_kv_cache_cpu(*args, pin_memory=True)


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
        self.registration: Optional[HostRegistration] = None  # the host pool's page-locking (on CUDA)
        if num_blocks == 0:
            return
        for _ in range(shape.num_layers):
            if index == HOST_POOL and pin_host:
                if self.registration is None:
                    self.registration = HostRegistration()
                k, v = _host_pinned_kv_cache(num_blocks, shape, self.registration)
            elif index == HOST_POOL:
                k, v = allocate_kv_cache_cpu(num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim,
                                             shape.dtype)
            else:
                k, v = allocate_kv_cache_gpu(num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim,
                                             shape.dtype, device)
            self.key_caches.append(k)
            self.value_caches.append(v)

    def close(self) -> None:
        """Drops the caches (unregistering the host pool's page-locking first)."""
        if self.registration is not None:
            self.registration.close()
        self.key_caches, self.value_caches = [], []


@dataclasses.dataclass
class BlockTable:
    """The blocks of one request, in token order, all in pool `pool`."""

    pool: int
    block_ids: List[int]


class SwapStream:
    """The side stream of block moves on CUDA: each move runs after the compute stream's work queued so far
    (steps queued ahead may still write the blocks) and returns the event of its end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, copy) -> torch.cuda.Event:
        """Queues `copy()` on the side stream after the compute stream's queued work; returns its end event."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copy()
        event = host_wait_event()  # the launching thread may wait on it (`host_ready`, `_reap`)
        event.record(self.stream)
        return event

    def order_compute(self, event: torch.cuda.Event) -> None:
        """Makes the compute stream's later work wait for `event` on the device (the host goes on)."""
        torch.cuda.current_stream(self.device).wait_event(event)


class KVManager:
    """Allocates blocks to requests in either pool, frees them, and moves whole requests between pools."""

    def __init__(self, shape: CacheShape, device_blocks: int, host_blocks: int, device: torch.device):
        self.shape = shape
        self.block_size = shape.block_size
        pin_host = device.type == "cuda"  # page-locked host pool: async swaps and staging copies
        self.pools = (KVPool(DEVICE_POOL, shape, device_blocks, device, pin_host),
                      KVPool(HOST_POOL, shape, host_blocks, torch.device("cpu"), pin_host))
        self.tables: Dict[int, BlockTable] = {}
        self._swap: Optional[SwapStream] = SwapStream(device) if device.type == "cuda" else None
        self._swap_event = None  # the last move the compute stream must follow (wait_for_moves)
        # overlapped moves: (event, pool, ids) of blocks freed while a move still reads or writes them, returned
        # once it lands; and the event of each request's copy into the host pool, for host code that reads it
        self._held: List[tuple] = []
        self._landing: Dict[int, object] = {}
        # called with host block ids before a move reads them or they are freed: the runner waits there for the
        # prompt K/V exports still writing them (`KVExports.settle`)
        self.settle_host: Callable[[List[int]], None] = lambda block_ids: None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def overlaps_moves(self) -> bool:
        """Whether moves are overlapped: on a device with a swap stream."""
        return self._swap is not None

    def num_free(self, pool: int) -> int:
        """Free blocks of `pool` (blocks of moves still in flight are not free yet)."""
        if self._held:
            self._reap()
        return self.pools[pool].allocator.num_free

    def num_held(self, pool: int) -> int:
        """Blocks of `pool` freed by moves still in flight (free once they land)."""
        return sum(len(ids) for _, held_pool, ids in self._held if held_pool == pool)

    def _reap(self, wait_pool: Optional[int] = None) -> None:
        """Returns held blocks whose move landed; with `wait_pool`, waits on the host for that pool's."""
        keep = []
        for event, pool, ids in self._held:
            if pool == wait_pool:
                event.synchronize()
            if pool == wait_pool or event.query():
                self.pools[pool].allocator.free(ids)
            else:
                keep.append((event, pool, ids))
        self._held = keep

    def host_ready(self, request_id: int) -> None:
        """Waits on the host until the request's copy into the host pool has landed (before host code reads or
        writes its blocks: a CPU attention job, a host-pool step)."""
        event = self._landing.pop(request_id, None)
        if event is not None:
            event.synchronize()

    def landed(self, request_id: int) -> bool:
        """Whether the request's copy into the host pool has landed, without waiting (True with none in flight);
        once it has, host code may read its blocks."""
        event = self._landing.get(request_id)
        if event is None:
            return True
        if not event.query():
            return False
        del self._landing[request_id]
        return True

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
        if need > self.num_free(pool) and self.num_held(pool):
            self._reap(wait_pool=pool)  # blocks of moves in flight: wait for them rather than fail
        if need > self.num_free(pool):
            return False
        if table is None:
            table = self.tables[request_id] = BlockTable(pool, [])
        table.block_ids.extend(self.pools[pool].allocator.allocate(need))
        return True

    def free(self, request_id: int) -> None:
        """Returns every block of the request (no-op when it holds none)."""
        table = self.tables.pop(request_id, None)
        if table is not None:  # a copy into either pool still landing keeps its blocks until it has
            self._release(table.pool, table.block_ids, self._in_flight(request_id, pop=True))

    def _in_flight(self, request_id: int, pop: bool = False):
        """The event of the request's copy still landing into its pool (None: none in flight)."""
        return (self._landing.pop if pop else self._landing.get)(request_id, None)

    def _release(self, pool: int, ids: List[int], event) -> None:
        """Frees `ids` of `pool` now, or once `event` (a move still using them) has landed."""
        if pool == HOST_POOL:
            self.settle_host(ids)
        if event is not None and not event.query():
            self._held.append((event, pool, ids))
        else:
            self.pools[pool].allocator.free(ids)

    def shrink(self, request_id: int, num_tokens: int) -> None:
        """Returns the request's blocks beyond those covering `num_tokens` tokens (a new table: rows written from
        the old one are rewritten, not extended)."""
        table = self.tables[request_id]
        keep = self.blocks_for(num_tokens)
        if keep < len(table.block_ids):
            self._release(table.pool, table.block_ids[keep:], self._in_flight(request_id))
            self.tables[request_id] = BlockTable(table.pool, table.block_ids[:keep])

    def can_move(self, request_id: int, dst_pool: int) -> bool:
        """Whether the destination pool has room for all the request's blocks."""
        table = self.tables[request_id]
        return table.pool != dst_pool and len(table.block_ids) <= self.num_free(dst_pool)

    def move(self, request_id: int, dst_pool: int, hold: bool = False) -> None:
        """Copies the request's blocks to `dst_pool` (every layer, K and V) and frees the source blocks.

        Without a swap stream (CPU) the copy runs at once. On CUDA the copies run on a side stream after the
        compute stream's queued work, overlapped: the compute stream waits on the device for a move into the
        device pool or one whose freed device blocks the next step may take; freed host blocks return once the move
        has read them; the destination host blocks are read by host code only after `host_ready`. hold: a park ahead
        (`Scheduler.park_launched`) whose device blocks the next step must not take: they return once the copy has
        read them, and the compute stream does not wait for it.
        """
        table = self.tables[request_id]
        if not self.can_move(request_id, dst_pool):
            raise RuntimeError(f"request {request_id}: no room to move it to the {POOL_NAMES[dst_pool]} pool")
        src, dst = self.pools[table.pool], self.pools[dst_pool]
        if src.index == HOST_POOL:
            self.settle_host(table.block_ids)
        dst_ids = dst.allocator.allocate(len(table.block_ids))
        self.tables[request_id] = BlockTable(dst_pool, list(dst_ids))  # grows later; the copy keeps its ids
        if self._swap is None:
            self._copy_layers(src, dst, table.block_ids, dst_ids)
            src.allocator.free(table.block_ids)
            return
        event = self._swap.run(lambda: self._copy_layers(src, dst, table.block_ids, dst_ids))
        self._landing.pop(request_id, None)  # a move still landing: this copy follows it on the swap stream
        if hold or src.index == HOST_POOL:
            self._held.append((event, src.index, table.block_ids))
        else:
            src.allocator.free(table.block_ids)
        if not (hold and src.index == DEVICE_POOL):
            self._swap_event = event
        if dst_pool == HOST_POOL:
            self._landing[request_id] = event

    @staticmethod
    def _copy_layers(src: KVPool, dst: KVPool, src_ids: List[int], dst_ids: List[int]) -> None:
        from apex_compile.ops import copy_blocks_layers

        copy_blocks_layers(list(src.key_caches) + list(src.value_caches),
                           list(dst.key_caches) + list(dst.value_caches), src_ids, dst_ids)

    def close(self) -> None:
        """Drops both pools' caches (after the moves in flight); block tables are forgotten."""
        self.sync_moves()
        for pool in self.pools:
            pool.close()
        self.tables = {}

    def wait_for_moves(self) -> None:
        """Orders the compute stream, on the device, after the block moves it must follow."""
        if self._swap_event is not None:
            self._swap.order_compute(self._swap_event)
            self._swap_event = None

    def sync_moves(self) -> None:
        """Waits on the host for every move issued so far and returns the blocks they held."""
        if self._swap is not None:
            self._swap.stream.synchronize()
        self._swap_event = None
        for event, pool, ids in self._held:
            self.pools[pool].allocator.free(ids)
        self._held, self._landing = [], {}

    def num_used(self, pool: int) -> int:
        """Blocks of `pool` held by requests."""
        return self.pools[pool].num_blocks - self.num_free(pool)

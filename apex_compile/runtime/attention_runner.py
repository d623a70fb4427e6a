"""The attention of one engine step over the paged device and host KV pools.

The engine orders a step's tokens as [device-pool tokens..., host-pool tokens...]; inside each pool first
the "paged" tokens (decode tokens, and chunks that continue a prompt whose earlier tokens are cached), then
the "fresh" chunks (the first chunk of a prompt, with no earlier context). Per layer:

- new K/V of each pool's tokens are appended to that pool's cache;
- paged tokens attend over the pool's cache: on the CPU kernels one decode row per token with its own context
  length (for a continued prompt chunk that is exactly causal attention over cache + chunk); on the GPU pool
  the decode kernel when every chunk is one token, else the paged prefill kernel over whole chunks;
- a fresh chunk attends to itself with causal SDPA on the model's device (for host-pool requests too);
- rows past the last pool's (padding of a captured step) are left unset: no pool holds them and nothing
  reads their outputs.

On CUDA, host-pool work runs on a CPU worker thread between `offload_launch` and `offload_wait` (pinned,
double-buffered staging; CUDA events order copies against the compute stream), so it overlaps the GPU's
device-pool attention. On a CPU-only machine both pools are host memory and everything runs synchronously.
"""
import collections
import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from apex_compile.kernels import paged_attention as decode_kernels
from apex_compile.kernels.paged_attention import cache_append_launch, paged_decode_append_launch, paged_decode_launch
from apex_compile.kernels.prefill_attention import default_prefill_config, paged_prefill_launch
from apex_compile.kernels.stagger import set_flag
from apex_compile.ops.cpu_attention import ExportLander, wait_host_flags
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, KVManager
from apex_compile.runtime.scheduler import ScheduledChunk
from apex_compile.runtime.step_buffers import PoolPart


def order_chunks(chunks: Sequence[ScheduledChunk]) -> List[ScheduledChunk]:
    """The step's token order: device pool then host pool; inside each, decode rows, then chunks that continue
    a prompt, then fresh ones (a mixed step's decode rows then run the decode kernel apart from its chunks)."""
    return sorted(chunks, key=lambda c: (c.pool, c.start == 0, c.num_tokens > 1))


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk to itself: q [c, Hq, D], k/v [c, Hkv, D] -> [c, Hq, D]."""
    q = query.transpose(0, 1).unsqueeze(0)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _attend_fresh(part: PoolPart, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  out: torch.Tensor) -> None:
    """Writes into `out` the causal attention of each fresh prompt chunk of `part` over its own K/V (the
    tensors hold exactly the part's rows)."""
    for begin, end in part.fresh:
        begin, end = begin - part.start, end - part.start
        out[begin:end] = prefill_attention(query[begin:end], key[begin:end], value[begin:end], scale)


class PagedAttentionRunner:
    """Implements `apex_compile.runtime.context.AttentionRunner` over a `KVManager`'s two pools."""

    def __init__(self, kv: KVManager, device: torch.device):
        from apex_compile.kernels._common import INTERPRET
        from apex_compile.ops import cache_append_cpu, paged_attention_cpu

        self.kv = kv
        self.device = device
        # On a CPU-only run the device pool is host memory too; the GPU ops' CPU kernels are these same C++ ops
        # behind an op wrapper (~0.2 ms per layer), so call them directly unless Triton is interpreted.
        self._device_is_cpu = device.type == "cpu" and not INTERPRET
        # The GPU kernels are launched directly, not through their torch ops: the engine builds valid tables
        # (the public wrappers check them, with a sync), and a mixed step runs these eagerly between its graph
        # pieces, where the dispatcher's hop per call is host time on the step's critical path. The fused
        # decode + append also writes into a given output (the staggered step's rows after its block).
        # On CUDA they skip their shape checks too (the engine builds these inputs, and a mixed step calls them
        # per layer from Python); the interpreter keeps them, with their checks of the data, for the tests.
        check = device.type != "cuda"
        self._append = {DEVICE_POOL: cache_append_cpu if self._device_is_cpu else functools.partial(
                            cache_append_launch, check=check),
                        HOST_POOL: cache_append_cpu}
        self._decode_append = functools.partial(paged_decode_append_launch, check=check)
        self._decode_append_unchecked = functools.partial(paged_decode_append_launch, check=False)
        self._paged_gpu = functools.partial(paged_decode_launch, check=check)
        self._prefill_gpu = functools.partial(paged_prefill_launch, check=check)
        self._paged_cpu = paged_attention_cpu
        self.parts: List[PoolPart] = []
        self.num_rows = 0
        self._whole_paged: Optional[PoolPart] = None  # set when one pool's paged rows are the step's (padding aside)
        self._async = _HostOffload(device) if device.type == "cuda" else None
        # fresh host-pool chunks' K/V on their way to the host cache (in the background: `exports.wait`)
        self.exports = KVExports(cache_append_cpu, background=device.type == "cuda")
        self._stash: dict = {}  # layer -> host rows' output (synchronous offload on a CPU-only machine)
        self.stagger = None  # the staggered plan's StaggerPipeline (its block: the step's first stagger_rows rows)
        self.stagger_rows = 0
        self.stagger_scale = 1.0
        # the layered exchange's stream, made here: a CUDA graph capture may not create one. The one-lane
        # staggered block's exchange (the device wait for the CPU job, the host reads and writes, the ready flag)
        # runs on it beside the device rows' attention, which needs none of it; the step joins it before the
        # layer's output is read, so the device rows never wait behind the CPU job
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def exports(self) -> "KVExports":
        return self._exports

    @exports.setter
    def exports(self, exports: "KVExports") -> None:
        """The exports, which the KV manager's host blocks settle on (the exports' own method: no reference back
        to the runner, so a runner let go without `close` is freed at once, its threads with it)."""
        self._exports = exports
        self.kv.settle_host = exports.settle

    def close(self) -> None:
        """Stops the runner's worker threads (exports land first)."""
        try:
            self.exports.close()
        finally:
            if self._async is not None:
                self._async.close()

    def prepare(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Builds the step's metadata in buffers sized for this step (standalone use; the engine fills its own
        persistent StepBuffers and calls `set_parts`); `chunks` must be in `order_chunks` order."""
        from apex_compile.runtime.step_buffers import StepBuffers

        num_rows = sum(c.num_tokens for c in chunks)
        longest = max((len(self.kv.tables[c.request.request_id].block_ids) * self.kv.block_size for c in chunks),
                      default=1)  # table width: every block a request holds
        self._own_buffers = StepBuffers(self.kv, max(num_rows, 2), longest, self.device)
        parts, rows = self._own_buffers.fill(list(chunks), [max(num_rows - 1, 0)])
        self._own_buffers.copy_to_device()
        self.set_parts(parts, rows)

    def set_parts(self, parts: List[PoolPart], num_rows: int, stagger_rows: int = 0) -> None:
        """Uses metadata built elsewhere (the engine's persistent StepBuffers) for the next step; the first
        `stagger_rows` rows are the staggered plan's block (no part covers them)."""
        self.stagger_rows = stagger_rows
        self.parts = parts
        self.num_rows = num_rows
        only = parts[0] if len(parts) == 1 and parts[0].start == 0 else None  # rows after it: padding
        self._whole_paged = only if only is not None and only.paged_end == only.end else None
        self._stash.clear()

    def compile_decode_variants(self, num_heads: int) -> None:
        """Runs every launch variant of the device pool's decode kernel once (with and without the fused append;
        64- and 128-token chunks; one split, or several merged in the kernel) on one dummy row that reads block
        0 and writes nothing, so that no step meets Triton's compile of a variant at its first use (about a
        second each: a warm-up's job). No-op without a CUDA device pool."""
        pool = self.kv.pools[DEVICE_POOL]
        if self._device_is_cpu or pool.device.type != "cuda" or not pool.key_caches:
            return
        key_cache, value_cache = pool.key_caches[0], pool.value_caches[0]
        _, num_kv_heads, block_size, head_dim = key_cache.shape
        options = dict(dtype=key_cache.dtype, device=key_cache.device)
        query = torch.zeros(1, num_heads, head_dim, **options)
        key = value = torch.zeros(1, num_kv_heads, head_dim, **options)
        slots = torch.full((1,), -1, dtype=torch.int64, device=key_cache.device)
        context = torch.ones(1, dtype=torch.int32, device=key_cache.device)
        for block_t in (decode_kernels.DECODE_BLOCK_T, decode_kernels.DECODE_BLOCK_T_SMALL_GRID):
            tables = torch.zeros(1, -(-2 * block_t // block_size), dtype=torch.int32, device=key_cache.device)
            for split in (None, block_t):  # one split (short table) / every chunk its own split
                table = tables[:, :-(-block_t // block_size)] if split is None else tables
                paged_decode_append_launch(query, key, value, key_cache, value_cache, slots, table, context,
                                           tokens_per_split=split, block_t=block_t)
                decode_kernels.paged_decode_launch(query, key_cache, value_cache, table, context,
                                                   tokens_per_split=split, block_t=block_t)
        torch.cuda.synchronize(key_cache.device)

    def _attend(self, part: PoolPart, layer_idx: int, query: torch.Tensor, scale: float,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Paged attention of the part's paged rows (query holds exactly those rows), written into `out` when
        given."""
        pool = part.pool
        if pool.index == DEVICE_POOL and not self._device_is_cpu:
            key_cache, value_cache = pool.key_caches[layer_idx], pool.value_caches[layer_idx]
            if part.query_start_loc is None:
                return self._paged_gpu(query, key_cache, value_cache, part.block_tables, part.context_lens, scale,
                                       part.max_context_len, out=out)
            # chunks of several tokens: causal over cache + chunk; the decode rows before them (a 128-row query
            # tile each in the prefill kernel) by the decode kernel
            out = torch.empty_like(query) if out is None else out
            n = part.num_decode
            if n:
                self._paged_gpu(query[:n], key_cache, value_cache, part.block_tables[:n], part.context_lens[:n],
                                scale, part.max_context_len, out=out[:n])
            self._prefill_gpu(query[n:], key_cache, value_cache, part.block_tables[n:], part.query_start_loc,
                              part.context_lens[n:], scale, part.max_query_len, out=out[n:])
            return out
        result = self._paged_cpu(query, pool.key_caches[layer_idx], pool.value_caches[layer_idx],
                                 part.block_tables, part.context_lens, scale)
        return result if out is None else out.copy_(result)

    @property
    def host_part(self) -> Optional[PoolPart]:
        """The host pool's rows of this step, if any."""
        return next((p for p in self.parts if p.pool.index == HOST_POOL), None)

    def _run_part(self, part: PoolPart, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Appends and attends one pool's rows (tensors already on the pool's device); returns their output
        (written into `out`, a contiguous tensor shaped like query, when given)."""
        index = part.pool.index
        key_cache, value_cache = part.pool.key_caches[layer_idx], part.pool.value_caches[layer_idx]
        if part.chunk_tables is not None:
            return self._run_mixed(part, query, key, value, key_cache, value_cache, scale, out)
        num_paged = part.paged_end - part.start
        if (index == DEVICE_POOL and not self._device_is_cpu and part.query_start_loc is None
                and num_paged == part.end - part.start):
            # every row decodes in the device pool: its append and its attention in one kernel
            return self._decode_append(query, key, value, key_cache, value_cache, part.slot_mapping,
                                       part.block_tables, part.context_lens, scale, part.max_context_len, out=out)
        self._append[index](key, value, key_cache, value_cache, part.slot_mapping)
        if num_paged == part.end - part.start:
            return self._attend(part, layer_idx, query, scale, out)
        if out is None:
            out = torch.empty_like(query)
        if num_paged:
            self._attend(part, layer_idx, query[:num_paged], scale, out[:num_paged])
        _attend_fresh(part, query, key, value, scale, out)
        return out

    def _run_mixed(self, part: PoolPart, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                   out: Optional[torch.Tensor]) -> torch.Tensor:
        """A mixed step's fixed layout (`StepBuffers.fill(mixed_rows=...)`), launched with grids that depend
        only on its row count, so one CUDA graph replays any step of that count: the fused decode + append
        over every row (each row's K/V into the cache; the chunks' rows attend their own token only and are
        overwritten), then the prefill kernel over the chunks (empty ones do no work). The decode launch skips
        its check that a row's slot is its last position (not so for a chunk's rows)."""
        out = self._decode_append_unchecked(query, key, value, key_cache, value_cache, part.slot_mapping,
                                            part.block_tables, part.context_lens, scale, None, out=out)
        # tiles for one chunk of every row: a prompt chunk beside a few decode rows (run at capture, not replay)
        config = default_prefill_config(query.shape[2], query.device, query.shape[1] * -(-query.shape[0] // 128))
        self._prefill_gpu(query, key_cache, value_cache, part.chunk_tables, part.query_start_loc,
                          part.chunk_context_lens, scale, part.max_query_len, config=config, out=out)
        return out

    def attention(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Appends every row's K/V to its request's cache and returns the attention output of all rows (written
        into `out`, a contiguous tensor shaped like query, when given: a piecewise graph's persistent buffer)."""
        whole = self._whole_paged
        if whole is not None and whole.pool.device == query.device:
            if whole.end == query.shape[0]:
                return self._run_part(whole, layer_idx, query, key, value, scale, out)
            out = torch.empty_like(query) if out is None else out  # rows past the part's: padding, unread
            rows = slice(0, whole.end)
            self._run_part(whole, layer_idx, query[rows], key[rows], value[rows], scale, out[rows])
            return out
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if not self.stagger_rows:
            return self._attend_parts(layer_idx, query, key, value, scale, out)
        # the staggered block's rows: their q/k/v staged for the CPU job, the outputs of the requests arriving
        # (the CPU attended them since the lane's last turn) into the block's output rows
        block = slice(0, self.stagger_rows)
        self.stagger_scale = scale  # the CPU job attends with it after the step
        side = self._exchange_stream(query)
        if side is None:
            self.stagger.exchange(layer_idx, query[block], key[block], value[block], out[block])
            return self._attend_parts(layer_idx, query, key, value, scale, out)
        main = torch.cuda.current_stream(query.device)
        side.wait_stream(main)  # q/k/v of the layer written
        with torch.cuda.stream(side):
            self.stagger.exchange(layer_idx, query[block], key[block], value[block], out[block])
        try:
            return self._attend_parts(layer_idx, query, key, value, scale, out)
        finally:
            main.wait_stream(side)  # the block's output rows written (also when a part failed to launch)

    def _exchange_stream(self, query: torch.Tensor) -> Optional[torch.cuda.Stream]:
        """The side stream of a layered exchange on a GPU (None: run it on the compute stream)."""
        if query.is_cuda and self.stagger.layered and self._side is not None:
            return self._side
        return None

    def _attend_parts(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float, out: torch.Tensor) -> torch.Tensor:
        """The rows after the staggered block (all rows without one): each pool part's attention into `out`."""
        if self.stagger_rows:
            part = self.parts[0] if len(self.parts) == 1 else None
            if part is not None and (part.start, part.end) == (self.stagger_rows, query.shape[0]) and (
                    part.pool.device == query.device):  # a decode step: the pool's rows written in place
                rows = slice(part.start, part.end)
                self._run_part(part, layer_idx, query[rows], key[rows], value[rows], scale, out=out[rows])
                return out
        for part in self.parts:
            rows = slice(part.start, part.end)
            if part.pool.device == query.device:
                self._run_part(part, layer_idx, query[rows], key[rows], value[rows], scale, out=out[rows])
            else:
                out[rows] = self._host_rows_from_device(part, layer_idx, query[rows], key[rows], value[rows],
                                                        scale).to(query.device)
        return out

    def stagger_residual(self, layer_idx: int, residual: torch.Tensor) -> torch.Tensor:
        """The residual with the staggered block's rows swapped (apex::stagger_residual)."""
        if not self.stagger_rows:
            return residual.clone()
        return self.stagger.swap_residual(layer_idx, residual)

    def stagger_rope_layers(self, num_layers: int, table: torch.Tensor, kind: int) -> torch.Tensor:
        """Every layer's RoPE table, the staggered block's rows for that layer's requests, [num_layers,
        *table.shape] (apex::stagger_rope_layers)."""
        if not self.stagger_rows:
            return table.unsqueeze(0).expand(num_layers, *table.shape).contiguous()
        return self.stagger.rope_rows_layers(table, kind)

    def _host_rows_from_device(self, part: PoolPart, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, scale: float) -> torch.Tensor:
        """Host-pool rows whose q/k/v are on the model's device: fresh chunks attend there and only their K/V
        cross to the host (for the cache, in the background); the paged rows (decode rows, continued chunks)
        attend on the CPU, only their q/k/v crossing and their output coming back (a continued chunk's step often
        holds the next prompt's fresh chunk, whose q, K/V and output need not cross every layer)."""
        out = torch.empty_like(query)
        num_paged = part.paged_end - part.start
        if num_paged:
            # the paged rows read their blocks of the host cache: the exports into them land first
            self.exports.wait(part.block_tables, part.context_lens)
            paged = dataclasses.replace(part, end=part.paged_end, slot_mapping=part.slot_mapping[:num_paged],
                                        fresh=[])
            rows = slice(0, num_paged)
            out[rows] = self._host_work(paged, layer_idx, query[rows].cpu(), key[rows].cpu(), value[rows].cpu(),
                                        scale).to(out.device)
        if part.fresh:
            _attend_fresh(part, query, key, value, scale, out)
            rows, pool = slice(num_paged, None), part.pool
            self.exports.submit(key[rows], value[rows], pool.key_caches[layer_idx], pool.value_caches[layer_idx],
                                part.slot_mapping[rows])
        return out

    def _host_work(self, part: PoolPart, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, scale: float) -> torch.Tensor:
        """CPU side of the host rows: append all rows' K/V, attend the paged rows (fresh rows left as they are)."""
        pool = part.pool
        key_cache, value_cache = pool.key_caches[layer_idx], pool.value_caches[layer_idx]
        self._append[HOST_POOL](key, value, key_cache, value_cache, part.slot_mapping)
        num_paged = part.paged_end - part.start
        out = torch.empty_like(query)
        if num_paged:
            out[:num_paged] = self._attend(part, layer_idx, query[:num_paged], scale)
        return out

    def offload_launch(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """Starts the host-pool rows: on CUDA asynchronously on the CPU worker; on a CPU-only run right away."""
        part = self.host_part
        if part is None:
            return query.new_zeros(1)
        # the host job reads and writes its rows' blocks of the host cache after the exports into them
        self.exports.wait(part.block_tables, part.context_lens)
        rows = slice(part.start, part.end)
        if self._async is None:
            self._stash[layer_idx] = self._run_part(part, layer_idx, query[rows], key[rows], value[rows], scale)
        else:
            self._async.launch(self, part, layer_idx, query[rows], key[rows], value[rows], scale)
        return query.new_zeros(1)

    def device_attention(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scale: float, token: torch.Tensor) -> torch.Tensor:
        """Appends and attends the device-pool rows; the host rows of the result are left unset."""
        part = next((p for p in self.parts if p.pool.index == DEVICE_POOL), None)
        if part is not None and part.end - part.start == query.shape[0]:
            return self._run_part(part, layer_idx, query, key, value, scale)
        out = torch.empty_like(query)
        if part is not None:
            rows = slice(part.start, part.end)
            out[rows] = self._run_part(part, layer_idx, query[rows], key[rows], value[rows], scale)
        return out

    def offload_wait(self, layer_idx: int, token: torch.Tensor, device_out: torch.Tensor) -> torch.Tensor:
        """Waits for the host rows started by `offload_launch` and returns the output with them filled in."""
        part = self.host_part
        if part is None:
            return device_out
        out = device_out.clone()
        rows = slice(part.start, part.end)
        if self._async is None:
            out[rows] = self._stash.pop(layer_idx)
        else:
            self._async.wait(layer_idx, out[rows])
        return out


class KVExports:
    """K/V of fresh host-pool prompt chunks computed on the GPU, appended to the host cache without stopping
    the step: each layer's K/V are copied into pinned memory on the compute stream, which then sets a pinned
    counter (`copied`) to the export's number; a C++ thread (`ExportLander`) appends each export once its number is
    up, in submission order, and sets `landed` to it. Landing needs no Python, no GIL and no CUDA call: a staggered
    CPU job gated on `landed` (which the GPU waits for) must never wait for what the launching thread is blocked in
    (a worker that needs the GIL to land an export can deadlock against the launcher's device wait). Whatever
    reads or writes host blocks first waits for the exports into those blocks only, not for other prompts' still on
    their way: CPU attention through its rows' tables (`gate`, `wait`), a move or a free through the KV manager
    (`settle`). With background=False (a CPU-only run) the append happens at once. Exports of CPU tensors with
    background=True (tests) count as copied as soon as `_copied_now` says so."""

    def __init__(self, append, background: bool):
        self.append = append
        # exports submitted; `copied` (raised behind each export's copy) and `landed` (raised by the lander after
        # each, in order, failed ones too): a thread that must not take the GIL waits for landed[0] >= submitted
        # (`gate`)
        self.submitted = 0
        counters = torch.zeros(2, dtype=torch.int64, pin_memory=background and torch.cuda.is_available())
        self.copied, self.landed = counters[:1], counters[1:]
        self._copied, self._landed = self.copied.numpy(), self.landed.numpy()
        # a few OpenMP threads: the appends are copies, and the staggered plan's CPU job needs the cores
        self.lander = (ExportLander(self.copied, self.landed, min(4, os.cpu_count() or 1))
                       if background else None)
        self._stream: Optional[int] = None  # the CUDA stream of every export's copy (their flags count in order)
        # the last exports queued: (number, perf_counter), for the error of a device wait that timed out behind a
        # job gated on them (`state`)
        self._queued: collections.deque = collections.deque(maxlen=4)
        # host block id -> the number of the last export that wrote into it (0: none); exports land in order,
        # so a block's K/V are in the cache once landed >= that number
        self._last_export = np.zeros(0, dtype=np.int64)
        self._block_size = 0

    def gate(self, block_tables: Optional[torch.Tensor] = None,
             context_lens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, int]:
        """(counter, value): every export submitted so far is in the host cache once counter[0] >= value; with
        block_tables [rows, width] and context_lens [rows] (CPU tensors or arrays), every export into the blocks
        those rows hold (their first ceil(context / block size) entries)."""
        if block_tables is None:
            return self.landed, self.submitted
        if not self._block_size or not len(block_tables):
            return self.landed, 0
        used = -(-np.asarray(context_lens).astype(np.int64) // self._block_size)
        tables = np.asarray(block_tables)[:, :int(used.max())]
        return self.landed, self.last_export(tables[np.arange(tables.shape[1]) < used[:, None]])

    def last_export(self, block_ids) -> int:
        """The number of the last export into these host blocks (0: none)."""
        ids = np.asarray(block_ids, dtype=np.int64).ravel()
        ids = ids[(ids >= 0) & (ids < len(self._last_export))]
        return int(self._last_export[ids].max()) if ids.size else 0

    def _mark(self, slots: torch.Tensor, block_size: int, index: int) -> None:
        """Export `index` writes the blocks of `slots` (CPU int64; a cache's blocks hold block_size tokens)."""
        if self._block_size and block_size != self._block_size:
            raise RuntimeError(f"KVExports: exports into caches of {block_size}- and {self._block_size}-token blocks")
        self._block_size = block_size
        ids = slots.numpy()
        blocks = np.unique(ids[ids >= 0] // block_size)
        if not blocks.size:
            return
        if blocks[-1] >= len(self._last_export):
            grown = np.zeros(max(int(blocks[-1]) + 1, 2 * len(self._last_export)), dtype=np.int64)
            grown[:len(self._last_export)] = self._last_export
            self._last_export = grown
        self._last_export[blocks] = index

    def submit(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slots: torch.Tensor) -> None:
        """Queues the append of key/value [n, Hkv, D] at `slots` (read now: the step's buffers are reused)."""
        self.submitted += 1
        index = self.submitted
        if self.lander is None:
            try:
                self.append(key.cpu(), value.cpu(), key_cache, value_cache, slots)
            finally:
                self._landed[0] = index
            return
        self.lander.poll()  # lets go of the landed exports' buffers (and raises a failed one's error)
        self._queued.append((index, time.perf_counter()))
        slots = slots.to("cpu", copy=True)
        self._mark(slots, key_cache.shape[2], index)
        if key.is_cuda:
            stream = torch.cuda.current_stream(key.device)
            if self._stream is None:
                self._stream = stream.cuda_stream
            elif stream.cuda_stream != self._stream:
                raise RuntimeError("KVExports: every export must be queued on one CUDA stream (their copy flags "
                                   "count in order)")
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (key, value)]
            for dst, src in zip(host, (key, value)):
                dst.copy_(src, non_blocking=True)
            set_flag(self.copied, index, key.device)
        else:
            host = [key.clone(), value.clone()]
            self._copied_now(index)
        self.lander.submit(index, host[0], host[1], key_cache, value_cache, slots)

    def _copied_now(self, index: int) -> None:
        """Export `index` of CPU tensors is in its buffers (tests delay this to play a copy still on its way)."""
        self._copied[0] = index

    def state(self) -> str:
        """Where the exports stand: how many were copied and landed, and when the last ones were queued."""
        now = time.perf_counter()
        told = [f"exports: {self.submitted} submitted, {int(self._copied[0])} copied, {int(self._landed[0])} landed"]
        told += [f"export {index} queued {now - queued:.1f} s ago" for index, queued in self._queued]
        return "; ".join(told)

    def queued(self) -> int:
        """How many exports are not yet in the host cache."""
        return self.submitted - int(self._landed[0])

    def wait(self, block_tables: Optional[torch.Tensor] = None, context_lens: Optional[torch.Tensor] = None) -> None:
        """Returns when every queued export is in the host cache, or with block_tables and context_lens those
        that wrote the rows' blocks (`gate`); raises the first error of a landed export."""
        self._wait_for(self.gate(block_tables, context_lens)[1])

    def settle(self, block_ids) -> None:
        """Returns once every export into these host blocks landed: before a move reads them or they are freed
        (an export landing in a block after its next owner wrote it would overwrite that). A failed export's
        error is left to the next `wait` or `submit`: the KV manager calls this midway through its bookkeeping."""
        self._wait_for(self.last_export(block_ids), poll=False)

    def _wait_for(self, value: int, poll: bool = True) -> None:
        if self.lander is None:
            return
        if self._landed[0] < value:
            wait_host_flags(self.landed, [value])
        if poll:
            self.lander.poll()

    def close(self) -> None:
        """Waits for the queued exports and stops the lander."""
        if self.lander is not None:
            lander, self.lander = self.lander, None
            lander.close()


class _HostOffload:
    """CUDA side of the host-pool rows: pinned double-buffered staging, a CPU worker thread, CUDA events.

    launch: the compute stream records an event after q/k/v exist; a copy stream waits for it and copies the
    host rows to pinned staging (buffer = layer parity); the worker waits for that copy, appends K/V to the
    host cache and attends into a pinned output buffer. Fresh chunks of host requests attend on the GPU right
    away. wait: joins the worker and copies the pinned output rows back on the compute stream; the event
    recorded after that copy guards the buffer before the worker reuses it two layers later.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="apex-offload")
        self.staging: List[dict] = [{}, {}]
        self.reuse_events: List[Optional[torch.cuda.Event]] = [None, None]
        self.pending: dict = {}

    def _buffer(self, parity: int, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self.staging[parity].get(name)
        if buf is None or buf.shape[0] < like.shape[0] or buf.shape[1:] != like.shape[1:] or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
            self.staging[parity][name] = buf
        return buf[:like.shape[0]]

    def launch(self, runner: PagedAttentionRunner, part: PoolPart, layer_idx: int, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, scale: float) -> None:
        """Starts D2H copies and submits the CPU append + attention of the host rows of `layer_idx`."""
        parity = layer_idx % 2
        fresh_out = [(b - part.start, e - part.start,
                      prefill_attention(query[b - part.start:e - part.start], key[b - part.start:e - part.start],
                                        value[b - part.start:e - part.start], scale))
                     for b, e in part.fresh]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        staged = {}
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            for name, tensor in (("q", query), ("k", key), ("v", value)):
                staged[name] = self._buffer(parity, name, tensor)
                staged[name].copy_(tensor, non_blocking=True)
            for tensor in (query, key, value):
                tensor.record_stream(self.copy_stream)
        copied = torch.cuda.Event()
        copied.record(self.copy_stream)
        out_buf = self._buffer(parity, "out", query)
        reuse = self.reuse_events[parity]

        def host_job():
            copied.synchronize()
            if reuse is not None:
                reuse.synchronize()
            with torch.inference_mode():  # thread-local: the staging buffers are inference tensors
                out_buf.copy_(runner._host_work(part, layer_idx, staged["q"], staged["k"], staged["v"], scale))

        self.pending[layer_idx] = (self.worker.submit(host_job), out_buf, fresh_out, parity)

    def close(self) -> None:
        """Stops the worker thread once its queued jobs are done (their outputs are dropped)."""
        self.pending = {}
        self.worker.shutdown(wait=True)
        self.staging = [{}, {}]

    def wait(self, layer_idx: int, out_rows: torch.Tensor) -> None:
        """Joins the layer's CPU job and writes its rows (and the fresh chunks' rows) into `out_rows`."""
        future, out_buf, fresh_out, parity = self.pending.pop(layer_idx)
        future.result()
        out_rows.copy_(out_buf, non_blocking=True)
        for begin, end, chunk_out in fresh_out:
            out_rows[begin:end] = chunk_out
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.reuse_events[parity] = event

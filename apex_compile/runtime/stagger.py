"""The staggered plan: host-pool requests that advance one decoder layer per step.

Why: every row of a layer's GEMMs needs that layer's attention done before the output projection, so in one
batch the CPU's attention of host rows can hide only behind the device rows' attention, a small part of a
step that is mostly weight reads (notes item 23). Here a host request instead moves one layer further each
step: its layer-L attention is launched on the CPU when the GPU reaches layer L, and its result is used when
the GPU reaches layer L again in the next step. So each CPU attention has a whole step to finish, the GPU
never waits while the CPU keeps up, and the weights are still read once per step (the host rows join the
device rows' GEMMs). A host request then takes num_layers + 1 steps per token: throughput, not latency.

Layout: the step's first `width` rows are the staggered block. Group g (0..num_layers) holds the requests
(one per row) that entered the pipeline g steps ago with their current token; at layer L the block's rows
hold group L before the attention op (their q/k/v are launched) and group L + 1 after it (their attention
from the step before is returned; the graph swaps their residual and RoPE rows, `passes.stagger`). Group 0
embeds its token, group num_layers gets the LM head and samples. Each step the groups shift by one; a
request that sampled and goes on re-enters group 0 in the same row, and free rows of group 0 take requests
that finished their prefill.

CPU side: per layer one job (append the group's K/V to the host cache, attend), run on a worker thread on
CUDA: the q/k/v rows go device-to-host on a copy stream into pinned staging, the output comes back from a
pinned buffer the next step; buffers alternate by step parity and the event recorded after each read guards
the buffer before it is written again. On a CPU-only run the jobs run at once and their outputs wait in a
stash for the next step.
"""
import collections
import concurrent.futures
import dataclasses
import os
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

from apex_compile.runtime.kv_manager import HOST_POOL, KVManager
from apex_compile.runtime.request import Request

ROPE_KINDS = ("cos", "sin")


@dataclasses.dataclass
class StaggerGroup:
    """The requests that entered the pipeline in one step (one per row, None for a free row) and the metadata
    of their CPU attention, fixed while their token crosses the layers."""

    requests: List[Optional[Request]]
    rows: Optional[torch.Tensor] = None  # int64 rows holding a request (None: no request)
    slots: Optional[torch.Tensor] = None  # int64 [n]: each row's cache slot of its token
    block_tables: Optional[torch.Tensor] = None  # int32 [n, width]
    context_lens: Optional[torch.Tensor] = None  # int32 [n]
    positions: Optional[np.ndarray] = None  # int64 [rows]: each row's token position (0 for a free row)
    prefix: int = 0  # rows 0..prefix-1 are exactly the rows holding a request (slicing instead of gathering)

    @property
    def size(self) -> int:
        return 0 if self.rows is None else int(self.rows.numel())


def rope_tables(model: torch.nn.Module, max_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE (cos, sin) rows for positions 0..max_len-1, [max_len, head_dim] each, as its rotary
    module computes them for a forward (scaling included)."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None:
        raise ValueError("the staggered plan needs the model's rotary embedding module (model.model.rotary_emb)")
    param = next(model.parameters())
    positions = torch.arange(max_len, device=param.device)[None]
    with torch.inference_mode():
        cos, sin = rotary(torch.zeros(1, dtype=param.dtype, device=param.device), positions)
    return cos[0].contiguous(), sin[0].contiguous()


class StaggerPipeline:
    """The groups of the staggered plan, their device-side row state and the CPU jobs (module docstring)."""

    def __init__(self, kv: KVManager, width: int, hidden_size: int, rope: Tuple[torch.Tensor, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, max_model_len: int, threads: Optional[int] = None):
        if width < 1:
            raise ValueError(f"the staggered plan needs at least one row per step, got width {width}")
        self.kv = kv
        self.width = width
        self.num_layers = kv.shape.num_layers
        self.device = device
        self.table_width = -(-max_model_len // kv.block_size)
        self.groups: List[StaggerGroup] = [self._group([None] * width) for _ in range(self.num_layers + 1)]
        self.joining: Deque[Request] = collections.deque()
        self.residual = torch.zeros(self.num_layers, width, hidden_size, dtype=dtype, device=device)
        self.rope = rope
        on_cuda = device.type == "cuda"
        self._positions_host = torch.zeros(self.num_layers, width, dtype=torch.int64, pin_memory=on_cuda)
        self.positions = self._positions_host.to(device) if on_cuda else self._positions_host
        self._positions_copied: Optional[torch.cuda.Event] = None
        self.executor = AsyncJobs(CudaCopies(device), threads=threads) if on_cuda else _SyncJobs()
        self.steps = 0
        self.quiet = False  # while graphs are captured: attention launches and returns nothing

    # ------------------------------------------------------------------------------------------------
    # requests

    @property
    def capacity(self) -> int:
        """Requests the pipeline holds at once (every row of every group)."""
        return len(self.groups) * self.width

    def members(self) -> List[Request]:
        """Every request in the pipeline (in a group or waiting to join)."""
        inside = [r for g in self.groups for r in g.requests if r is not None]
        return inside + list(self.joining)

    @property
    def active(self) -> bool:
        """Whether a group holds a request (then every step runs the staggered block)."""
        return any(r is not None for g in self.groups for r in g.requests)

    def join(self, request: Request) -> None:
        """Queues a host-pool request whose prefill is done (its last token not yet computed)."""
        self.joining.append(request)

    def sampling_rows(self) -> List[Tuple[int, Request]]:
        """(row, request) of the last group: the rows whose logits give a token this step."""
        return [(row, r) for row, r in enumerate(self.groups[-1].requests) if r is not None]

    def remove(self, request_ids) -> List[Request]:
        """Takes these requests out of the pipeline (their CPU jobs drained first); returns them."""
        ids = set(request_ids)
        removed = [r for r in self.joining if r.request_id in ids]
        self.joining = collections.deque(r for r in self.joining if r.request_id not in ids)
        if any(r is not None and r.request_id in ids for g in self.groups for r in g.requests):
            self.executor.drain()
            for group in self.groups:
                for row, r in enumerate(group.requests):
                    if r is not None and r.request_id in ids:
                        removed.append(r)
                        group.requests[row] = None
        return removed

    def finish(self, request: Request) -> None:
        """The last group's request is done: its row is free from the next step on."""
        last = self.groups[-1].requests
        last[last.index(request)] = None

    def advance(self) -> None:
        """Starts a step: the groups shift by one, the last group re-enters as group 0 and free rows of
        group 0 take joining requests; then the positions of every layer's rows go to the device."""
        last = self.groups.pop()
        entering = last.requests
        for row in range(self.width):
            if entering[row] is None and self.joining:
                entering[row] = self.joining.popleft()
        self.groups.insert(0, self._group(entering))
        self.steps += 1
        if self._positions_copied is not None:
            self._positions_copied.synchronize()
        for layer in range(self.num_layers):
            self._positions_host[layer] = torch.from_numpy(self.groups[layer].positions)
        if self.positions is not self._positions_host:
            self.positions.copy_(self._positions_host, non_blocking=True)
            self._positions_copied = torch.cuda.Event()
            self._positions_copied.record()

    def _group(self, requests: List[Optional[Request]]) -> StaggerGroup:
        """Group 0 of this step: each request attends its token at position num_computed (its last)."""
        rows = [row for row, r in enumerate(requests) if r is not None]
        positions = np.zeros(self.width, dtype=np.int64)
        group = StaggerGroup(list(requests), positions=positions)
        if not rows:
            return group
        bs = self.kv.block_size
        tables = np.zeros((len(rows), self.table_width), dtype=np.int32)
        slots, lens = [], []
        for i, row in enumerate(rows):
            request = requests[row]
            position = request.num_computed
            block_ids = self.kv.tables[request.request_id].block_ids
            tables[i, :len(block_ids)] = block_ids
            slots.append(block_ids[position // bs] * bs + position % bs)
            lens.append(position + 1)
            positions[row] = position
        group.rows = torch.tensor(rows, dtype=torch.int64)
        group.slots = torch.tensor(slots, dtype=torch.int64)
        group.block_tables = torch.from_numpy(tables)
        group.context_lens = torch.tensor(lens, dtype=torch.int32)
        group.prefix = len(rows) if rows == list(range(len(rows))) else 0
        return group

    def input_ids(self) -> List[int]:
        """The token each row of group 0 embeds (0 for a free row)."""
        out = []
        for r in self.groups[0].requests:
            out.append(0 if r is None else (r.prompt_token_ids + r.output_token_ids)[r.num_computed])
        return out

    # ------------------------------------------------------------------------------------------------
    # the graph's stagger ops (device copies at fixed addresses)

    def swap_residual(self, layer: int, residual: torch.Tensor) -> torch.Tensor:
        """The residual with the block's rows swapped: the rows' own value goes to the layer's store, the
        stored one (the arriving requests', from the step before) comes back."""
        out = residual.clone(memory_format=torch.contiguous_format)
        flat_in = residual.reshape(-1, residual.shape[-1])
        out.view(-1, out.shape[-1])[:self.width].copy_(self.residual[layer])
        self.residual[layer].copy_(flat_in[:self.width])
        return out

    def rope_rows(self, layer: int, table: torch.Tensor, kind: int) -> torch.Tensor:
        """`table` (the step's RoPE cos or sin) with the block's rows at the positions of the layer's group."""
        out = table.clone(memory_format=torch.contiguous_format)
        flat = out.view(-1, out.shape[-1])
        flat[:self.width].copy_(self.rope[kind].index_select(0, self.positions[layer]))
        return out

    # ------------------------------------------------------------------------------------------------
    # attention of the block's rows

    def attention(self, runner, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float, out: torch.Tensor) -> None:
        """Launches group `layer`'s attention (rows of q/k/v) and writes group `layer + 1`'s, launched the step
        before, into `out` (the block's rows of the layer's output)."""
        if self.quiet:
            out.zero_()
            return
        group = self.groups[layer]
        job = None
        if group.size:
            pool = self.kv.pools[HOST_POOL]
            key_cache, value_cache = pool.key_caches[layer], pool.value_caches[layer]

            def job(q, k, v):
                return host_attention(runner, group, q, k, v, key_cache, value_cache, scale)

        self.executor.launch(layer, self.steps, job, query, key, value)
        self.executor.collect(layer, self.steps, out)


def host_attention(runner, group: StaggerGroup, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """CPU side of one group at one layer: appends its rows' K/V and attends them; returns [rows, Hq, D] with
    the free rows' outputs zero."""
    if group.prefix:
        rows = slice(0, group.prefix)
        q, k, v = query[rows], key[rows], value[rows]
    else:
        q, k, v = query[group.rows], key[group.rows], value[group.rows]
    runner._append[HOST_POOL](k, v, key_cache, value_cache, group.slots)
    attended = runner._paged_cpu(q, key_cache, value_cache, group.block_tables, group.context_lens, scale)
    out = torch.zeros_like(query)
    if group.prefix:
        out[:group.prefix] = attended
    else:
        out[group.rows] = attended
    return out


class _SyncJobs:
    """CPU-only run: a job runs when launched; its output is returned when its layer comes round again."""

    def __init__(self):
        self.stash: Dict[int, Optional[torch.Tensor]] = {}

    def launch(self, layer, step, job, query, key, value) -> None:
        self._next = (layer, None if job is None else job(query, key, value))

    def collect(self, layer, step, out: torch.Tensor) -> None:
        previous = self.stash.get(layer)
        if previous is None:
            out.zero_()
        else:
            out.copy_(previous)
        self.stash[layer] = self._next[1]

    def drain(self) -> None:
        """Nothing runs in the background."""


class CudaCopies:
    """The copies of `AsyncJobs` on CUDA: q/k/v to pinned staging on a copy stream ordered after the compute
    stream, outputs back on the compute stream; each returns an event."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def stage(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        """Copies each (pinned dst, device src) after the work queued so far on the compute stream."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.copy_stream)
        copied = torch.cuda.Event()
        copied.record(self.copy_stream)
        return copied

    def restore(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """Copies the pinned `src` into the device `dst` on the compute stream."""
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done


def worker_cores(threads: Optional[int] = None) -> List[int]:
    """The cores of the CPU attention worker: the last `threads` of those this process may use (None: all
    but the first when there are more than two)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    if threads is None:
        threads = len(cores) - 1 if len(cores) > 2 else len(cores)
    if not 1 <= threads <= len(cores):
        raise ValueError(f"cpu_attention_threads must be in 1..{len(cores)} (the cores this process may use), "
                         f"got {threads}")
    return cores[len(cores) - threads:]


def _pin_worker(cores: List[int]) -> None:
    """Worker-thread initializer: this thread (and the OpenMP team it starts) runs on `cores`, that many
    threads wide (the OpenMP thread count is per calling thread)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


class AsyncJobs:
    """Asynchronous CPU jobs: q/k/v rows are staged into pinned buffers (`copies.stage`), a worker thread runs
    the job into a pinned output buffer, and the next step copies it back (`copies.restore`). Staging and
    output buffers alternate by step parity; an output buffer is rewritten only after the event of its last
    copy back (the guard)."""

    def __init__(self, copies, pin_memory: bool = True, threads: Optional[int] = None):
        """threads: the worker's OpenMP threads, pinned to the last `threads` cores this process may use (None:
        all of them but the first, left to the thread that launches GPU work)."""
        self.copies = copies
        self.pin_memory = pin_memory
        self.cores = worker_cores(threads)
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="apex-stagger",
                                                            initializer=_pin_worker, initargs=(self.cores,))
        self.buffers: Dict[tuple, torch.Tensor] = {}
        self.guards: Dict[tuple, object] = {}
        self.pending: Dict[int, Tuple[Optional[concurrent.futures.Future], int]] = {}
        self._launched: Optional[tuple] = None

    def _buffer(self, name: str, layer: int, parity: int, like: torch.Tensor) -> torch.Tensor:
        key = (name, layer, parity)
        buf = self.buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.buffers[key] = torch.zeros(like.shape, dtype=like.dtype, pin_memory=self.pin_memory)
        return buf

    def launch(self, layer, step, job, query, key, value) -> None:
        parity = step % 2
        if job is None:
            self._launched = (layer, None, parity)
            return
        staged = [self._buffer(name, layer, parity, t) for name, t in (("q", query), ("k", key), ("v", value))]
        copied = self.copies.stage(list(zip(staged, (query, key, value))))
        out_buf = self._buffer("out", layer, parity, query)
        guard = self.guards.get(("out", layer, parity))

        def run():
            copied.synchronize()
            if guard is not None:
                guard.synchronize()  # the last copy out of this buffer is done before it is rewritten
            with torch.inference_mode():
                out_buf.copy_(job(*staged))

        self._launched = (layer, self.worker.submit(run), parity)

    def collect(self, layer, step, out: torch.Tensor) -> None:
        previous = self.pending.get(layer)
        self.pending[layer] = self._launched[1:]
        if previous is None or previous[0] is None:
            out.zero_()
            return
        future, parity = previous
        future.result()
        self.guards[("out", layer, parity)] = self.copies.restore(out, self.buffers[("out", layer, parity)])

    def drain(self) -> None:
        """Waits for every launched job (before their requests' blocks are freed)."""
        for future, _ in self.pending.values():
            if future is not None:
                future.result()

"""Persistent step inputs: allocated once at the engine's maxima, written in place each step.

Everything a step's graph reads (input ids, positions, logits indices, and the device pool's slot mapping,
context lengths and block tables) lives in one byte arena with a pinned host mirror; a step writes the mirror
through numpy views and moves the used prefix with one host-to-device copy. The tensors handed to the model
and the attention ops are views at fixed addresses, so a CUDA graph captured over them replays any later
step of its size. Host-pool metadata is read by the CPU kernels and stays in host memory.

Block tables have a fixed width, cdiv(max_model_len, block_size); a row is rewritten only when another
request takes it or its request gains blocks (then only the new entries).

A mixed step replayed as one CUDA graph (`fill(..., mixed_rows=n)`) has a layout whose kernel grids do not
depend on the step: the decode kernel runs over all n rows (it appends every row's K/V; the rows of prompt
chunks attend with context length 1 and are then overwritten), and the prefill kernel over MIXED_CHUNKS
sequences (empty ones past the step's chunks) whose table rows and context lengths come first.
"""
import dataclasses
from typing import List, Optional, Tuple

import numpy as np
import torch

from apex_compile.ops.kv_layout import to_device
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, BlockTable, KVManager, KVPool
from apex_compile.runtime.sampler import host_wait_event
from apex_compile.runtime.scheduler import ScheduledChunk

_ALIGN = 64
MIXED_CHUNKS = 8  # prompt chunks a mixed step's fixed layout holds (the prefill launch's sequences)


class _Arena:
    """Typed views carved out of one byte buffer; `like(device)` repeats the layout on another device."""

    def __init__(self):
        self.layout: List[Tuple[str, int, int, torch.dtype, tuple]] = []  # name, offset, bytes, dtype, shape
        self.nbytes = 0

    def add(self, name: str, dtype: torch.dtype, shape: tuple) -> None:
        size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        self.layout.append((name, self.nbytes, size, dtype, shape))
        self.nbytes += -(-size // _ALIGN) * _ALIGN

    def add_pool_rows(self, prefix: str, max_tokens: int, width: int) -> None:
        """One pool's metadata rows: slots, context lengths, query starts, block tables (last)."""
        self.add(prefix + "slot", torch.int64, (max_tokens,))
        self.add(prefix + "ctx", torch.int32, (max_tokens,))
        self.add(prefix + "qstart", torch.int32, (max_tokens + 1,))
        self.add(prefix + "tables", torch.int32, (max_tokens, width))

    def offset(self, name: str) -> int:
        return next(off for n, off, _, _, _ in self.layout if n == name)

    def allocate(self, device: torch.device, pin: bool = False) -> Tuple[torch.Tensor, dict]:
        """(byte buffer, {name: typed view}) of this layout on `device` (zero-filled)."""
        buf = torch.zeros(max(self.nbytes, _ALIGN), dtype=torch.uint8, device=device, pin_memory=pin)
        return buf, {name: buf[off:off + size].view(dtype).view(shape) for name, off, size, dtype, shape in self.layout}


@dataclasses.dataclass
class PoolPart:
    """The rows of one pool in a step and the metadata its ops need (tensors on the pool's device).

    Paged rows (decode tokens, tokens of a chunk continuing a cached prompt) come first, fresh chunks (a prompt's
    first chunk, attended to itself by SDPA) follow. Block-table rows and context lengths are per token for the
    CPU kernels (a decode row each), per chunk for the GPU pool's kernels (decode kernel, or the paged prefill
    kernel when a chunk has several tokens); there every chunk is paged, a first chunk included.
    """

    pool: KVPool
    start: int  # first row of the pool in the step
    end: int
    paged_end: int  # rows start..paged_end-1 are paged rows, the rest fresh chunks
    slot_mapping: torch.Tensor  # int64 [end - start] (padding rows: -1)
    block_tables: Optional[torch.Tensor]  # int32 [paged rows, width]
    context_lens: Optional[torch.Tensor]  # int32 [paged rows]
    max_context_len: Optional[int]  # host-side bound of context_lens (tunes split-K); None: the table's capacity
    fresh: List[Tuple[int, int]]  # (start, end) rows of each fresh chunk
    # Sequence layout (the device pool's Triton kernels): one table row and context length per paged chunk, and
    # query_start_loc [chunks + 1] (rows relative to `start`) when a chunk has several tokens (prefill kernel).
    query_start_loc: Optional[torch.Tensor] = None
    max_query_len: int = 1
    # With query_start_loc: the leading decode rows (a table row each) that the decode kernel serves apart;
    # query_start_loc then covers the chunks after them, rows relative to the first chunk's.
    num_decode: int = 0
    # The fixed layout of a mixed step's whole graph: block_tables / context_lens have a row per step row (the
    # decode kernel's, chunk rows at context length 1), these a row per chunk (MIXED_CHUNKS, empty ones last),
    # and query_start_loc [MIXED_CHUNKS + 1] holds the chunks' rows relative to `start`.
    chunk_tables: Optional[torch.Tensor] = None
    chunk_context_lens: Optional[torch.Tensor] = None


@dataclasses.dataclass
class DeviceIds:
    """Input ids already on the device (a step queued before the host has them): step row rows[i] takes
    tokens[sources[i]]."""

    tokens: torch.Tensor
    rows: List[int]
    sources: List[int]

    def runs(self) -> List[Tuple[int, int, int]]:
        """(first row, first source, length) of each run where both rows and sources are consecutive."""
        runs: List[Tuple[int, int, int]] = []
        for row, source in zip(self.rows, self.sources):
            if runs and runs[-1][0] + runs[-1][2] == row and runs[-1][1] + runs[-1][2] == source:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((row, source, 1))
        return runs


MAX_ID_RUNS = 3  # DeviceIds of more runs are gathered in one indexed copy (their indices copied first)


class _PoolRows:
    """A pool's metadata rows in a host arena (and, for the device pool on CUDA, its device twin)."""

    def __init__(self, views: dict, dev_views: dict, prefix: str, per_chunk: bool):
        self.per_chunk = per_chunk  # table rows per chunk (GPU kernels) rather than per token (CPU kernels)
        self.slot = views[prefix + "slot"].numpy()
        self.ctx = views[prefix + "ctx"].numpy()
        self.qstart = views[prefix + "qstart"].numpy()
        self.tables = views[prefix + "tables"].numpy()
        self.dev_slot = dev_views[prefix + "slot"]
        self.dev_ctx = dev_views[prefix + "ctx"]
        self.dev_qstart = dev_views[prefix + "qstart"]
        self.dev_tables = dev_views[prefix + "tables"]
        self.row_table: List[Optional[BlockTable]] = [None] * self.tables.shape[0]
        self.row_len = [0] * self.tables.shape[0]

    def write_table(self, row: int, table: BlockTable) -> None:
        """Makes table row `row` hold `table`'s block ids, writing only what changed since the last step."""
        ids = table.block_ids
        have = self.row_len[row] if self.row_table[row] is table else 0
        if have < len(ids):
            self.tables[row, have:len(ids)] = ids[have:]
            self.row_table[row], self.row_len[row] = table, len(ids)


class StepBuffers:
    """The engine's persistent step inputs (see the module docstring)."""

    def __init__(self, kv: KVManager, max_tokens: int, max_model_len: int, device: torch.device,
                 per_chunk: Optional[bool] = None):
        """per_chunk: the device pool's table layout (None: per chunk where it runs the Triton kernels, on CUDA
        or under TRITON_INTERPRET; per token where the CPU kernels serve it)."""
        self.kv = kv
        self.width = -(-max_model_len // kv.block_size)
        on_cuda = device.type == "cuda"
        arena = _Arena()
        arena.add("input_ids", torch.int64, (max_tokens,))
        arena.add("positions", torch.int64, (max_tokens,))
        arena.add("logits_indices", torch.int64, (max_tokens,))
        # tables last: a step copies the rows it uses; MIXED_CHUNKS more rows for a mixed step's chunk rows
        arena.add_pool_rows("d_", max_tokens + MIXED_CHUNKS, self.width)
        self._tables_offset = arena.offset("d_tables")
        self.host_buf, host = arena.allocate(torch.device("cpu"), pin=on_cuda)
        if on_cuda:
            self.dev_buf, dev = arena.allocate(device)
        else:
            self.dev_buf, dev = self.host_buf, host
        host_arena = _Arena()  # host-pool rows: read on the CPU, never copied
        host_arena.add_pool_rows("h_", max_tokens, self.width)
        _, host_pool = host_arena.allocate(torch.device("cpu"))
        self.ids, self.positions = host["input_ids"].numpy(), host["positions"].numpy()
        self.logits_indices = host["logits_indices"].numpy()
        self.dev_ids, self.dev_positions = dev["input_ids"], dev["positions"]
        self.dev_logits_indices = dev["logits_indices"]
        from apex_compile.kernels._common import INTERPRET

        if per_chunk is None:
            per_chunk = on_cuda or INTERPRET  # the device pool then runs the Triton kernels
        self.rows = {DEVICE_POOL: _PoolRows(host, dev, "d_", per_chunk),
                     HOST_POOL: _PoolRows(host_pool, host_pool, "h_", False)}
        self._copy_bytes = 0
        self._copied: Optional[torch.cuda.Event] = None  # the last copy; the mirror is not rewritten before it

    def fill(self, chunks: List[ScheduledChunk], logit_rows: List[int], pad_to: Optional[int] = None,
             total_rows: Optional[int] = None, first_row: int = 0, mixed_rows: Optional[int] = None
             ) -> Tuple[List[PoolPart], int]:
        """Writes the step's inputs (chunks in `order_chunks` order) and returns (pool parts, rows).

        pad_to: pad a decode-only step of the device pool to that many rows (slot -1, context length 1, input
        id 0; no chunks at all gives a step of padding only): the rows of a whole-forward graph. Its part then
        covers the padded rows, and its split-K is planned for the table's capacity.
        total_rows: pad any step to that many rows with rows of no pool after the last part (input id 0,
        position 0; no attention reads or writes them): the rows of a piecewise-captured step.
        first_row: the pools' rows start there; the rows before it (the staggered block) are written by the
        caller into `ids` / `positions` (after `fill`, which waits for the previous copy).
        mixed_rows: the fixed layout of a mixed step's whole graph (module docstring), the device pool padded
        to that many rows (every chunk in the device pool, at most MIXED_CHUNKS of them with several tokens or
        a prompt's first token; `mixed_fits` says); the logits rows are padded like a piecewise step's.
        Call `copy_to_device` once before the step runs.
        """
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        row, parts, used_table_rows = first_row, [], 0
        for pool_index in (DEVICE_POOL, HOST_POOL):
            pool_chunks = [c for c in chunks if c.pool == pool_index]
            padded = (pad_to is not None or mixed_rows is not None) and pool_index == DEVICE_POOL
            if not pool_chunks and not padded:
                continue
            if mixed_rows is not None:
                if pool_index != DEVICE_POOL:
                    raise ValueError("a mixed step's fixed layout holds device-pool chunks only")
                part, used_table_rows = self._fill_mixed(pool_chunks, row, mixed_rows)
            else:
                part = self._fill_pool(pool_index, pool_chunks, row, pad_to if padded else None)
                if pool_index == DEVICE_POOL and part.block_tables is not None:
                    used_table_rows = part.block_tables.shape[0]
            parts.append(part)
            row = part.end
        if total_rows is not None and total_rows > row:
            self.ids[row:total_rows], self.positions[row:total_rows] = 0, 0
            row = total_rows
        count = len(logit_rows) if pad_to is None else pad_to
        self.logits_indices[:count] = logit_rows if pad_to is None else np.arange(pad_to)
        self._copy_bytes = self._tables_offset + used_table_rows * self.width * 4
        return parts, row

    def _fill_pool(self, pool_index: int, chunks: List[ScheduledChunk], start: int, pad_to: Optional[int]
                   ) -> PoolPart:
        """Writes one pool's rows from `start` (paged chunks first, then fresh ones) and returns its part."""
        kv = self.kv
        ids, positions, rows = self.ids, self.positions, self.rows[pool_index]
        row, entries, max_ctx, max_q, fresh = start, 0, 0, 1, []  # entries: table rows written
        num_decode = None  # per-chunk tables: the decode rows before the first chunk of several tokens
        for chunk in chunks:
            request, first, n = chunk.request, chunk.start, chunk.num_tokens
            if num_decode is None and (n > 1 or not first):
                num_decode = entries
            table = kv.tables[request.request_id]
            # The GPU kernels attend a prompt's first chunk from the cache too (appended first): with it among
            # the paged chunks a mixed step's attention is one prefill launch, not one SDPA call per chunk.
            paged = first or rows.per_chunk
            if paged and rows.per_chunk:
                rows.write_table(entries, table)
                rows.ctx[entries] = first + n
                if num_decode is not None:  # a chunk's first row, from the first chunk's
                    rows.qstart[entries] = row - start - num_decode
                entries += 1
                max_q = max(max_q, n)
            row = self._write_tokens(rows, chunk, row, start)
            if first and not rows.per_chunk:  # the CPU kernels: a table row per token of a continued chunk
                for p in range(first, first + n):
                    rows.write_table(entries, table)
                    rows.ctx[entries] = p + 1
                    entries += 1
            if paged:
                max_ctx = max(max_ctx, first + n)
            else:
                fresh.append((row - n, row))
        paged_end = fresh[0][0] if fresh else row
        if pad_to is not None:
            end = start + pad_to
            ids[row:end], positions[row:end] = 0, 0
            rows.slot[row - start:pad_to] = -1
            rows.ctx[entries:pad_to] = 1
            entries, row = pad_to, end
            paged_end = row
        qstart, num_decode = None, (num_decode or 0) if max_q > 1 else 0
        if max_q > 1:
            rows.qstart[entries] = paged_end - start - num_decode
            qstart = rows.dev_qstart[num_decode:entries + 1]
        return PoolPart(kv.pools[pool_index], start, row, paged_end, rows.dev_slot[:row - start],
                        rows.dev_tables[:entries] if entries else None, rows.dev_ctx[:entries] if entries else None,
                        None if pad_to is not None else max_ctx, fresh, qstart, max_q, num_decode)

    def _write_tokens(self, rows: "_PoolRows", chunk: ScheduledChunk, row: int, start: int) -> int:
        """Writes the input id, position and cache slot of each of the chunk's tokens from step row `row` (slots
        relative to the pool's first row `start`); returns the row after them."""
        request, first = chunk.request, chunk.start
        block_ids, bs = self.kv.tables[request.request_id].block_ids, self.kv.block_size
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        n_prompt, known = len(prompt), request.num_tokens
        ids, positions, slot = self.ids, self.positions, rows.slot
        for p in range(first, first + chunk.num_tokens):
            # a token not yet on the host (a step queued before its predecessor's ids came back): 0 here, the
            # sampled id copied on the device by the engine
            ids[row] = prompt[p] if p < n_prompt else (outputs[p - n_prompt] if p < known else 0)
            positions[row] = p
            slot[row - start] = block_ids[p // bs] * bs + p % bs
            row += 1
        return row

    @staticmethod
    def mixed_fits(chunks: List[ScheduledChunk]) -> bool:
        """Whether a step's chunks fit a mixed step's fixed layout: all in the device pool, at most MIXED_CHUNKS
        of them prompt chunks (several tokens, or a prompt's first token)."""
        return (all(c.pool == DEVICE_POOL for c in chunks)
                and sum(1 for c in chunks if c.num_tokens > 1 or not c.start) <= MIXED_CHUNKS)

    def _fill_mixed(self, chunks: List[ScheduledChunk], start: int, num_rows: int) -> Tuple[PoolPart, int]:
        """Writes the device pool's rows from `start` in a mixed step's fixed layout (module docstring), padded
        to `num_rows` rows; returns its part and the table rows in use. Table rows: MIXED_CHUNKS chunk rows, then
        one per step row (written for decode rows only: a chunk row attends its own token, and stale rows hold
        valid ids)."""
        kv, rows = self.kv, self.rows[DEVICE_POOL]
        ids, positions = self.ids, self.positions
        if not rows.per_chunk:
            raise ValueError("a mixed step's fixed layout is for the GPU kernels (per-chunk table rows)")
        row, seq, decode_rows = start, 0, 0
        for chunk in chunks:
            request, first, n = chunk.request, chunk.start, chunk.num_tokens
            table = kv.tables[request.request_id]
            is_chunk = n > 1 or not first
            if is_chunk:
                if seq == MIXED_CHUNKS:
                    raise ValueError(f"a mixed step's fixed layout holds at most {MIXED_CHUNKS} prompt chunks")
                rows.write_table(seq, table)
                rows.ctx[seq] = first + n
                rows.qstart[seq] = row - start
                seq += 1
            elif seq:
                raise ValueError("a mixed step's decode rows come before its prompt chunks (order_chunks)")
            else:
                rows.write_table(MIXED_CHUNKS + row - start, table)
                decode_rows += 1
            rows.ctx[MIXED_CHUNKS + row - start:MIXED_CHUNKS + row - start + n] = 1 if is_chunk else first + 1
            row = self._write_tokens(rows, chunk, row, start)
        if row - start > num_rows:
            raise ValueError(f"{row - start} rows do not fit a mixed layout of {num_rows}")
        end = start + num_rows
        ids[row:end], positions[row:end] = 0, 0
        rows.slot[row - start:num_rows] = -1
        rows.ctx[MIXED_CHUNKS + row - start:MIXED_CHUNKS + num_rows] = 1
        rows.qstart[seq:MIXED_CHUNKS + 1] = row - start  # empty chunks past the step's
        rows.ctx[seq:MIXED_CHUNKS] = 1  # (an empty chunk reads nothing)
        tokens = MIXED_CHUNKS + num_rows
        part = PoolPart(kv.pools[DEVICE_POOL], start, end, end, rows.dev_slot[:num_rows],
                        rows.dev_tables[MIXED_CHUNKS:tokens], rows.dev_ctx[MIXED_CHUNKS:tokens], None, [],
                        rows.dev_qstart[:MIXED_CHUNKS + 1], num_rows, 0,
                        rows.dev_tables[:MIXED_CHUNKS], rows.dev_ctx[:MIXED_CHUNKS])
        return part, MIXED_CHUNKS + decode_rows  # the table rows written: the step copies up to there

    def copy_to_device(self, device_ids: Optional[DeviceIds] = None) -> None:
        """The step's one host-to-device copy (the used prefix of the arena; no-op on a CPU-only run), then
        `device_ids` (ids already on the device: a step queued before the host has them) into their rows of the
        input ids, over the placeholders written there: a device copy per run of rows, or one indexed copy."""
        if self.dev_buf is not self.host_buf:
            n = self._copy_bytes
            self.dev_buf[:n].copy_(self.host_buf[:n], non_blocking=True)
            self._copied = host_wait_event()
            self._copied.record()
        if device_ids is None or not device_ids.rows:
            return
        tokens, runs = device_ids.tokens, device_ids.runs()
        if len(runs) <= MAX_ID_RUNS:
            for row, source, n in runs:
                self.dev_ids[row:row + n].copy_(tokens[source:source + n])
            return
        index = to_device([device_ids.rows, device_ids.sources], torch.int64, tokens.device)
        self.dev_ids.index_copy_(0, index[0], tokens.index_select(0, index[1]).to(self.dev_ids.dtype))

    def inputs(self, num_rows: int, num_logits: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [1, rows], position_ids [1, rows], logits_indices [num_logits]): views of the buffers,
        contiguous (a [1, rows] slice of a [1, max] buffer would carry stride max, and dynamo guards on it)."""
        return (self.dev_ids[:num_rows].unsqueeze(0), self.dev_positions[:num_rows].unsqueeze(0),
                self.dev_logits_indices[:num_logits])

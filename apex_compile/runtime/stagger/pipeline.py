"""The staggered pipeline's state machine: the lanes' groups, the requests' rows and turns, the device-side row
state the graph splices in, and each turn's CPU job (the package docstring tells the plan)."""
import collections
import contextlib
import dataclasses
import time
from typing import Deque, List, Optional, Tuple

import numpy as np
import torch

from apex_compile.config import TuningConfig
from apex_compile.kernels._common import INTERPRET
from apex_compile.kernels.stagger import exchange_rows, exchange_rows_waiting, raise_flag, swap_rows
from apex_compile.ops.cpu_attention import stagger_cpu_job, wait_host_flags
from apex_compile.runtime.kv_manager import HOST_POOL, KVManager
from apex_compile.runtime.request import Request
from apex_compile.runtime.sampler import host_wait_event
from apex_compile.runtime.stagger.jobs import AsyncJobs, CudaCopies, LayerJobs, SyncJobs
from apex_compile.runtime.stagger.row_limit import RowLimit

ROPE_KINDS = ("cos", "sin")
LANES = 2  # lanes taking turns by default (1: one lane whose layers wait on the device, `LayerJobs`)


@dataclasses.dataclass
class StaggerGroup:
    """The requests that entered a lane in one turn (one per row, None for a free row) and the metadata of
    their CPU attention, fixed while their token crosses the layers."""

    requests: List[Optional[Request]]
    rows: Optional[np.ndarray] = None  # int64 rows holding a request (None: no request)
    slots: Optional[np.ndarray] = None  # int64 [n]: each row's cache slot of its token
    block_tables: Optional[np.ndarray] = None  # int32 [n, table width]
    context_lens: Optional[np.ndarray] = None  # int32 [n]
    positions: Optional[np.ndarray] = None  # int64 [rows]: each row's token position (0 for a free row)
    prefix: int = 0  # rows 0..prefix-1 are exactly the rows holding a request (slicing instead of gathering)
    # the number of the last prompt K/V export into its rows' blocks, once a job beside pending exports asked
    # (its requests decode, so no later export writes those blocks)
    last_export: Optional[int] = None

    @property
    def size(self) -> int:
        return 0 if self.rows is None else len(self.rows)


@dataclasses.dataclass
class HostJob:
    """A lane turn's CPU attention metadata over every layer's group, one row per request-layer: built on the
    launching thread while the GPU runs, so the worker thread runs one C++ call (`host_attention`) that needs no
    GIL: the main thread holds it for most of the host gap between two steps, just when the job's inputs
    arrive."""

    cache_index: torch.Tensor  # int32 [n]: the layer (host cache) of each row
    block_tables: torch.Tensor  # int32 [n, table width]
    context_lens: torch.Tensor  # int32 [n]
    slots: torch.Tensor  # int64 [n]
    rows: Optional[torch.Tensor]  # int64 [n]: the rows in the [layers * width] block; None: all, in order

    @classmethod
    def of(cls, groups: List[StaggerGroup], width: int) -> Optional["HostJob"]:
        """The job of groups[l] at layer l (None: no group holds a request)."""
        used = [(layer, g) for layer, g in enumerate(groups) if g.size]
        if not used:
            return None
        sizes = [g.size for _, g in used]
        cache_index = np.repeat(np.array([layer for layer, _ in used], dtype=np.int32), sizes)
        full = len(used) == len(groups) and all(g.prefix == width for _, g in used)
        rows = None if full else torch.from_numpy(np.concatenate([g.rows + layer * width for layer, g in used]))
        return cls(torch.from_numpy(cache_index),
                   torch.from_numpy(np.concatenate([g.block_tables for _, g in used])),
                   torch.from_numpy(np.concatenate([g.context_lens for _, g in used])),
                   torch.from_numpy(np.concatenate([g.slots for _, g in used])), rows)


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
    """The lanes of the staggered plan, their device-side row state and the CPU jobs (package docstring)."""

    def __init__(self, kv: KVManager, width: int, hidden_size: int, num_heads: int,
                 rope: Tuple[torch.Tensor, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 max_model_len: int, threads: Optional[int] = None, adaptive: bool = False,
                 prior_rate: Optional[float] = None, lanes: int = LANES, layered: Optional[bool] = None,
                 job_share: float = TuningConfig.job_share):
        """adaptive: the rows that take requests follow the measured CPU job (`RowLimit`, with the profiled
        `prior_rate`); else all `width`. lanes: 2 (the jobs between steps) or 1 (each layer's job between that
        layer of two steps). layered: the one-lane jobs run beside the step, waited for on the device
        (`LayerJobs`; default: on CUDA and under the Triton interpreter); else each runs whole after its step (CPU
        only)."""
        if width < 1:
            raise ValueError(f"the staggered plan needs at least one row per step, got width {width}")
        if lanes not in (1, 2):
            raise ValueError(f"stagger_lanes must be 1 or 2, got {lanes}")
        if layered is None:  # wherever the device waits (Triton kernels) can run
            layered = lanes == 1 and (device.type == "cuda" or INTERPRET)
        if layered and lanes != 1:
            raise ValueError("the layered CPU jobs belong to the one-lane plan (lanes=1)")
        if lanes == 1 and device.type == "cuda" and not layered:
            raise ValueError("on CUDA the one-lane plan's jobs run beside the step (layered)")
        if layered and device.type != "cuda" and not INTERPRET:
            raise ValueError("the layered CPU jobs' device waits are Triton kernels: a GPU or TRITON_INTERPRET=1")
        self.num_lanes = lanes
        self.layered = layered
        shape = kv.shape
        self.kv = kv
        self.width = width
        self.num_layers = shape.num_layers
        self.device = device
        self.table_width = -(-max_model_len // kv.block_size)
        self.lanes: List[List[StaggerGroup]] = [[self._group([None] * width) for _ in range(self.num_layers + 1)]
                                                for _ in range(lanes)]
        self.joining: Deque[Request] = collections.deque()
        self.inside = 0  # requests in the groups of both lanes (kept by begin_step, finish, remove)
        # offload="auto": closed to new requests, its members finishing (`StaggeredPlan.update_ceiling`)
        self.closed = False
        self.evicted = 0  # requests sent back to wait in `joining` by a fallen row limit (begin_step)
        self.stalled = 0  # turns a member waited in `joining` for a host block for its next token (begin_step)
        self.keep_free = 0  # host blocks a member's growth leaves free (the scheduler's room to park into)
        # ids of members bound for the device pool: at their next token boundary they wait in `joining` (not
        # re-entering a group), from where the engine parks them to resume in the device pool
        self.leaving: set = set()
        self.rope = rope
        self.steps = 0
        self.begun = False  # begin_step ran for a step whose end_step has not
        self.rows = RowLimit(width, self.num_layers, adaptive, prior_rate, cycle=lanes * (self.num_layers + 1),
                             job_share=job_share)
        self._last_begin: Optional[float] = None
        # turns whose step time and wait are not a decode step's: a step with prompt chunks was queued in them or in
        # the two turns before (steps are queued ahead; a prompt's export can delay the jobs after it)
        self._prompt_turns = 0
        # whether the last launched job ran beside prompt K/V still on their way into the host cache: a fill's
        # exports (64 MiB a 512-token Llama-3-8B prompt) lag its prompt steps by many turns, and its jobs and step
        # then measure the exports' contention, not the rows' cost
        self._beside_exports = False
        on_cuda = device.type == "cuda"
        layers = self.num_layers

        def device_buffer(*size, dtype=dtype):
            return torch.zeros(*size, dtype=dtype, device=device)

        # fixed-address device state the graphs read and write (the current lane's)
        self.residual = device_buffer(layers, width, hidden_size)
        # each layer's positions of the block's rows, then for the one-lane plan's device waits the turn whose
        # job the step waits for (the last launched) and the step's own turn (its flags): one copy per step
        self._block_state = device_buffer(layers * width + 2, dtype=torch.int64)
        self.positions = self._block_state[:-2].view(layers, width)
        self.after, self.turn = self._block_state[-2:-1], self._block_state[-1:]
        self._launched = 0  # the last turn whose layered job was launched
        # the block's q, k, v heads side by side per row: one splice per layer in, one copy per step out
        self.heads = (num_heads, shape.num_kv_heads, shape.num_kv_heads)
        self.staged = device_buffer(layers, width, sum(self.heads), shape.head_dim)
        self.outputs = device_buffer(layers, width, num_heads, shape.head_dim)
        # each lane's own rows (one lane: the block's rows stay in `residual`)
        self.lane_residual = [torch.zeros_like(self.residual) for _ in range(lanes)] if lanes > 1 else []
        # the block's RoPE cos / sin rows at every layer, gathered once per step (the graph only splices them in)
        self.rope_rows = [torch.zeros(layers, width, t.shape[-1], dtype=t.dtype, device=device) for t in rope]
        self._block_host = torch.zeros(layers * width + 2, dtype=torch.int64, pin_memory=on_cuda)
        self._positions_copied: Optional[torch.cuda.Event] = None
        if layered:
            host = kv.pools[HOST_POOL]
            self.executor = LayerJobs(self.staged, self.outputs, pin_memory=on_cuda, threads=threads,
                                      caches=(host.key_caches, host.value_caches))
        else:
            self.executor = AsyncJobs(CudaCopies(device), threads=threads) if on_cuda else SyncJobs()

    # ------------------------------------------------------------------------------------------------
    # requests

    @property
    def groups(self) -> List[StaggerGroup]:
        """The groups of the lane whose turn the current step is."""
        return self.lanes[self.steps % self.num_lanes]

    @property
    def host_rows(self) -> float:
        """Host rows per layer of the current step's lane: its groups' mean size (what its CPU job and auto's
        model price; fractional while the groups differ, 0.0 when no group holds a request)."""
        return sum(g.size for g in self.groups) / len(self.groups) if self.active else 0.0

    @property
    def cycle(self) -> int:
        """Steps between two tokens of a member: lanes x (layers + 1)."""
        return self.num_lanes * (self.num_layers + 1)

    @property
    def capacity(self) -> int:
        """Requests the pipeline takes at once (every row in use of every group of every lane)."""
        return self.num_lanes * self.rows.capacity_rows(self.num_layers + 1)

    def _inside(self) -> List[Request]:
        return [r for lane in self.lanes for g in lane for r in g.requests if r is not None]

    def members(self) -> List[Request]:
        """Every request in the pipeline (in a group or waiting to join)."""
        return self._inside() + list(self.joining)

    @property
    def num_members(self) -> int:
        """len(members()), without walking the groups (asked several times per step)."""
        return self.inside + len(self.joining)

    @property
    def active(self) -> bool:
        """Whether a group holds a request (then every step runs the staggered block)."""
        return self.inside > 0

    def join(self, request: Request) -> None:
        """Queues a host-pool request whose prefill is done (its last token not yet computed)."""
        self.joining.append(request)

    @property
    def measures_decode(self) -> bool:
        """No prompt step in the last turns and no prompt export beside the last job: a step now measures the
        rows' decode cost (as `RowLimit.observe_step` reads it)."""
        return not (self._prompt_turns or self._beside_exports)

    def note_prompt_step(self) -> None:
        """The engine queued a step with prompt chunks: this turn's and the next two's step times and waits are no
        decode step's (`RowLimit.observe_step`; a prompt's export into the host cache can hold the jobs of the
        steps after it)."""
        self._prompt_turns = 3

    def idle_step(self) -> None:
        """A step with no request in the pipeline: the next turn's step time starts afresh (not from the last
        turn before the pause), and the row limit counts towards its probe (`RowLimit.idle_step`)."""
        self._last_begin = None
        self.rows.idle_step()

    def pending_input_rows(self) -> List[Tuple[int, Request]]:
        """(row, request) of the current turn's group-0 rows whose input token the host does not have yet (one
        lane: a request that sampled in the step before re-enters at once; a step queued before that token
        reaches the host takes it on the device)."""
        return [(row, r) for row, r in enumerate(self.groups[0].requests)
                if r is not None and r.num_computed >= r.num_tokens]

    def sampling_rows(self) -> List[Tuple[int, Request]]:
        """(row, request) of the current lane's last group: the rows whose logits give a token this step."""
        return [(row, r) for row, r in enumerate(self.groups[-1].requests) if r is not None]

    def remove(self, request_ids) -> List[Request]:
        """Takes these requests out of the pipeline (the CPU jobs drained first); returns them."""
        ids = set(request_ids)
        self.leaving -= ids
        removed = [r for r in self.joining if r.request_id in ids]
        self.joining = collections.deque(r for r in self.joining if r.request_id not in ids)
        if any(r.request_id in ids for r in self._inside()):
            self.executor.drain()
            for lane in self.lanes:
                for index, group in enumerate(lane):
                    hits = [row for row, r in enumerate(group.requests) if r is not None and r.request_id in ids]
                    for row in hits:
                        removed.append(group.requests[row])
                        group.requests[row] = None
                    if hits:  # its CPU metadata rebuilt too: no later job appends into the freed blocks
                        self.inside -= len(hits)
                        lane[index] = self._group(group.requests)
        return removed

    def finish(self, request: Request) -> None:
        """A request that sampled is done; its row is freed so that no CPU job appends into its freed blocks.
        In the last group (two lanes: its jobs were collected) the row is just freed. With the next turn begun
        before its token came back, it re-entered group 0 (no job yet), which is rebuilt without it. One lane with
        a step queued ahead: it went on to group 1, into that step's job, so it is removed (`remove` drains the
        job first)."""
        self.leaving.discard(request.request_id)
        for lane in self.lanes:
            for index, group in enumerate(lane):
                row = next((row for row, r in enumerate(group.requests) if r is request), None)
                if row is None:
                    continue
                if index == len(lane) - 1 and not self.layered:
                    group.requests[row] = None
                    self.inside -= 1
                elif index == 0 and (self.begun or not self.layered):
                    group.requests[row] = None
                    self.inside -= 1
                    lane[0] = self._group(group.requests)
                else:
                    self.remove([request.request_id])
                return
        if request in self.joining:  # that turn sent it back to wait (a fallen row limit)
            self.joining.remove(request)
            return
        raise ValueError(f"request {request.request_id} is not in the staggered pipeline")

    def close(self) -> None:
        """Stops the CPU jobs' worker (its running job finishes first)."""
        self.executor.close()

    @contextlib.contextmanager
    def quiet(self):
        """While graphs of the staggered step are captured (their warm-up runs execute): the block's residual
        rows are put back afterwards. Layered jobs: drained first, and the device's turn is 0 meanwhile, so the
        warm-up's waits pass at once and its flags tell no job anything (both turns and the flags restored
        after)."""
        saved = self.residual.clone()
        turn = ready = None
        on_cuda = self.device.type == "cuda"
        if self.layered:
            self.executor.drain()
            if on_cuda:
                torch.cuda.synchronize(self.device)
            turn, ready = self._block_state[-2:].clone(), self.executor.ready.clone()
            self._block_state[-2:].zero_()
        try:
            yield
        finally:
            if on_cuda and turn is not None:
                torch.cuda.synchronize(self.device)
            self.residual.copy_(saved)
            if turn is not None:
                self._block_state[-2:].copy_(turn)
                self.executor.ready.copy_(ready)

    # ------------------------------------------------------------------------------------------------
    # a step: begin (host to device), the forward, end (device to host, CPU job)

    def begin_step(self) -> None:
        """Before a step (the engine calls it while the GPU still runs the step before, after its `end_step`): the
        next lane's groups shift by one (the last re-enters as group 0 up to the row limit, free rows of group 0
        take joining requests); its positions and residual rows go to the fixed device buffers, queued behind the
        running step. `collect` then brings the attention outputs of its CPU job. A request enters group 0 only
        with a host block for its next token (taken now where it lacks one: members grow their blocks as they
        go), else it waits in `joining`."""
        self.begun = True
        self.steps += 1
        lane = self.lanes[self.steps % self.num_lanes]
        entering = lane.pop().requests
        limit = self._row_limit(lane)
        # requests going on beyond the limit (it fell: a CPU behind, or the model's ceiling) wait first in line
        # to rejoin, their blocks kept
        evicted, used, stalled, left = [], 0, set(), 0
        for row, r in enumerate(entering):
            if r is None:
                continue
            if r.request_id in self.leaving:
                left += 1
            elif used < limit and self._has_block(r):
                used += 1
                continue
            elif used < limit:
                stalled.add(r.request_id)
            entering[row] = None
            evicted.append(r)
        self.inside -= len(evicted)
        self.joining.extendleft(reversed(evicted))
        self.evicted += len(evicted) - len(stalled) - left
        # free rows take joining requests in order, passing over those without a block for their next token
        free_rows = collections.deque(row for row in range(self.width) if entering[row] is None)
        passed = []
        while free_rows and used < limit and self.joining:
            r = self.joining.popleft()
            if r.request_id in self.leaving or not self._has_block(r):
                if r.request_id not in self.leaving:
                    stalled.add(r.request_id)
                passed.append(r)
                continue
            entering[free_rows.popleft()] = r
            self.inside += 1
            used += 1
        self.joining.extendleft(reversed(passed))
        self.stalled += len(stalled)
        lane.insert(0, self._group(entering))
        if self._positions_copied is not None:
            self._positions_copied.synchronize()  # the pinned positions are not rewritten under their copy
        host = self._block_host.numpy()
        np.stack([g.positions for g in lane[:self.num_layers]], out=host[:-2].reshape(self.num_layers, self.width))
        host[-2:] = self._launched, self.steps
        self._block_state.copy_(self._block_host, non_blocking=True)
        if self.device.type == "cuda":
            self._positions_copied = host_wait_event()
            self._positions_copied.record()
        flat_positions = self.positions.reshape(-1)
        for table, rows in zip(self.rope, self.rope_rows):
            torch.index_select(table, 0, flat_positions, out=rows.view(-1, rows.shape[-1]))
        if self.num_lanes > 1:
            self.residual.copy_(self.lane_residual[self.steps % self.num_lanes])

    def can_grow(self, request: Request) -> bool:
        """Whether the request's host blocks cover its next token, or the host pool can add them and still keep
        `keep_free` blocks free (a device request parked there costs less than a member recomputed)."""
        need = self.kv.extra_blocks(request.request_id, request.num_computed + 1)
        return not need or self.kv.num_free(HOST_POOL) >= need + self.keep_free

    def _has_block(self, request: Request) -> bool:
        """`can_grow`, taking the blocks it lacks."""
        return self.can_grow(request) and self.kv.grow(request.request_id, HOST_POOL, request.num_computed + 1)

    def _row_limit(self, lane: List[StaggerGroup]) -> int:
        """The rows of the entering group that may hold a request this turn (`RowLimit`), after the step time
        since the last turn (less the launching thread's wait for a CPU job) is recorded."""
        rows = self.rows
        if rows.adaptive:
            now = time.perf_counter()
            if self._last_begin is not None:
                waits = getattr(self.executor, "collect_seconds", None)
                waited = waits[-1] if waits else 0.0
                rows.observe_step(now - self._last_begin - waited, waited,
                                  decode=not (self._prompt_turns or self._beside_exports),
                                  in_use=sum(g.size for g in lane) / max(len(lane), 1))
            self._last_begin = now
            lens = [g.context_lens for g in lane if g.size]
            rows.update(float(np.concatenate(lens).mean()) if lens else 0.0)
        self._prompt_turns = max(self._prompt_turns - 1, 0)
        # admitted requests (inside, or waiting to join) keep at least one row, so they all finish; unless the
        # model's ceiling is 0 (auto: host rows no longer pay): then the pipeline empties as its requests sample,
        # and the engine parks them (`StaggeredPlan._park_idle_pipeline`)
        limit = rows.turn_rows((self.steps // self.num_lanes) % (self.num_layers + 1))
        return max(limit, 1) if (self.joining or self.inside) and rows.ceiling else limit

    def collect(self) -> None:
        """Just before a begun step's forward: the attention outputs its lane's CPU job computed during the step
        before go to the device (waiting for the job only here, where the GPU would wait for it)."""
        self.executor.collect(self.steps % self.num_lanes, self.outputs)

    def end_step(self, runner) -> None:
        """After the step's forward: the lane keeps its residual rows, and its staged q/k/v of every layer go
        to the CPU worker, which appends and attends them (done before the lane's next turn)."""
        self.begun = False
        index = self.steps % self.num_lanes
        if self.num_lanes > 1:
            self.lane_residual[index].copy_(self.residual)
        lane = list(self.lanes[index])
        if self.layered:
            self._launched = self.steps
        exports = runner.exports.queued()  # prompt K/V still on their way into the host cache
        self._beside_exports = bool(exports)
        if not any(g.size for g in lane[:self.num_layers]):
            self.executor.launch(index if not self.layered else self.steps, None, [self.staged], self.outputs)
            return
        pool = self.kv.pools[HOST_POOL]
        plan = HostJob.of(lane[:self.num_layers], self.width)
        work = int(plan.context_lens.sum())
        # a job beside prompt steps or their exports tells nothing of its rows' cost
        decode = not (self._prompt_turns or exports)
        num_heads = self.heads[0]

        # the job starts once the exports into its rows' blocks landed (not those of prompts it does not read)
        landed = max((self._last_export(g, runner.exports) for g in lane[:self.num_layers] if g.size),
                     default=0) if exports else 0
        gate = runner.exports.landed if landed else None
        if self.layered:
            def observe(waited, ran, busy):  # a job's timings into the row fit
                fit = busy / len(self.executor.cores) if busy > 0 else ran  # (0: no rows)
                self.rows.observe_job(fit, work, decode)

            self.executor.gate_state = runner.exports.state
            self.executor.submit(self.steps, observe, cache_index=plan.cache_index, block_tables=plan.block_tables,
                                 context_lens=plan.context_lens, slot_mapping=plan.slots, rows=plan.rows,
                                 num_heads=num_heads, scale=runner.stagger_scale, gate=gate, gate_value=landed)
            return

        def job(staged, out, ready_flags, ready_values):
            if gate is not None:
                wait_host_flags(gate, [landed])
            seconds = host_attention(plan, staged, num_heads, pool.key_caches, pool.value_caches,
                                     runner.stagger_scale, out, ready_flags, ready_values)
            self.rows.observe_job(seconds[1], work, decode)
            return seconds

        self.executor.launch(index, job, [self.staged], self.outputs)

    @staticmethod
    def _last_export(group: StaggerGroup, exports) -> int:
        """The last export into the group's blocks (`KVExports.gate`), asked once per group."""
        if group.last_export is None:
            group.last_export = exports.gate(group.block_tables, group.context_lens)[1]
        return group.last_export

    def _group(self, requests: List[Optional[Request]]) -> StaggerGroup:
        """Group 0 of a lane's turn: each request attends its token at position num_computed (its last)."""
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
        group.rows = np.array(rows, dtype=np.int64)
        group.slots = np.array(slots, dtype=np.int64)
        group.block_tables = tables
        group.context_lens = np.array(lens, dtype=np.int32)
        group.prefix = len(rows) if rows == list(range(len(rows))) else 0
        return group

    def input_ids(self) -> List[int]:
        """The token each row of the current lane's group 0 embeds (0 for a free row, and for a token not yet on
        the host: `pending_input_rows`)."""
        out = []
        for r in self.groups[0].requests:
            if r is None or r.num_computed >= r.num_tokens:
                out.append(0)
            else:
                prompt = len(r.prompt_token_ids)
                at = r.num_computed
                out.append(r.prompt_token_ids[at] if at < prompt else r.output_token_ids[at - prompt])
        return out

    # ------------------------------------------------------------------------------------------------
    # the graph's side: device copies at fixed addresses

    def exchange(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor) -> None:
        """The attention op's block rows at `layer`: stages their q/k/v for the CPU and writes into `out` (the
        block's rows of the op's output) the layer's attention of the requests arriving (computed since the
        lane's last turn, brought by `collect`); one Triton kernel on a GPU or under the interpreter."""
        if self.layered:  # the host buffers directly, after the device waits for the CPU job of the turn before
            jobs = self.executor
            exchange_rows_waiting(query, key, value, jobs.staged[layer], jobs.outputs[layer], out,
                                  jobs.done[layer:layer + 1], self.after, jobs.status, jobs.stalls[layer:layer + 1])
            raise_flag(jobs.ready[layer:layer + 1], self.turn)
            return
        staged, arriving = self.staged[layer], self.outputs[layer]
        if (query.is_cuda or INTERPRET) and all(t.stride(-1) == 1 for t in (query, key, value)):
            exchange_rows(query, key, value, staged, arriving, out)
            return
        torch.cat([query, key, value], dim=1, out=staged)
        out.copy_(arriving)

    def swap_residual(self, layer: int, residual: torch.Tensor) -> torch.Tensor:
        """The residual with the block's rows swapped: the rows' own value goes to the layer's store, the
        stored one (the arriving requests', from the lane's last turn) comes back (one Triton kernel on a GPU
        or under the interpreter; a splice and a copy in torch otherwise)."""
        flat_in = residual.reshape(-1, residual.shape[-1])
        if (flat_in.is_cuda or INTERPRET) and flat_in.stride(-1) == 1:
            return swap_rows(flat_in, self.residual[layer]).view(residual.shape)
        out = torch.cat([self.residual[layer], flat_in[self.width:]]).view(residual.shape)
        self.residual[layer].copy_(flat_in[:self.width])
        return out

    def rope_rows_layers(self, table: torch.Tensor, kind: int) -> torch.Tensor:
        """`table` (the step's RoPE cos or sin) for every layer, [layers, *table.shape], the block's rows at the
        positions of each layer's group (gathered by `begin_step`): one splice kernel per step."""
        flat = table.reshape(-1, table.shape[-1])
        rest = flat[self.width:].unsqueeze(0).expand(self.num_layers, -1, -1)
        out = torch.cat([self.rope_rows[kind].to(table.dtype), rest], dim=1)
        return out.view(self.num_layers, *table.shape)


def host_attention(job: Optional[HostJob], staged: torch.Tensor, num_heads: int, key_caches: List[torch.Tensor],
                   value_caches: List[torch.Tensor], scale: float, out: torch.Tensor,
                   ready_flags: Optional[torch.Tensor] = None, ready_values: Tuple[int, ...] = ()
                   ) -> Tuple[float, float]:
    """CPU side of a lane's turn: group l's rows append their K/V to layer l's host cache and attend it, every
    layer in one call that waits for its ready flags first and needs no GIL until it is done (the launching
    thread holds the GIL for most of the host work between two steps). staged [layers, width,
    Hq + 2 * Hkv, D] (q, k, v heads side by side), out [layers, width, Hq, D]; rows without a request are left
    as they are. Returns (seconds waiting for the flags, seconds running)."""
    if job is None:
        return 0.0, 0.0
    return stagger_cpu_job(staged, key_caches, value_caches, job.cache_index, job.block_tables, job.context_lens,
                           job.slots, job.rows, num_heads, scale, out, ready_flags, ready_values)

"""The staggered plan: host-pool requests whose tokens cross the decoder layers one layer per turn.

Why: every row of a layer's GEMMs needs that layer's attention done before the output projection, so in one
batch the CPU's attention of host rows can hide only behind the device rows' attention, a small part of a
step that is mostly weight reads. Here a host request's token instead moves one layer
further per turn, and the CPU attends each layer between two turns, while the GPU runs whole steps: the GPU
never waits while the CPU keeps up, and the weights are still read once per step (the host rows join the
device rows' GEMMs).

Layout: the step's first `width` rows are the staggered block. Two lanes take turns (even and odd steps);
each lane's group g (0..num_layers) holds the requests (one per row) that entered it g turns ago with their
current token. In a lane's step the block's rows at layer L hold group L before the attention op (their
q/k/v are staged for the CPU) and group L + 1 after it (they get the attention of layer L computed since the
lane's last step; the graph swaps their residual and RoPE rows, `passes.stagger`). Group 0 embeds its token,
group num_layers gets the LM head and samples. Each turn the groups shift by one; a request that sampled and
goes on re-enters group 0 in the same row, free rows of group 0 take requests that finished their prefill.
A host token thus takes 2 * (num_layers + 1) steps: throughput, not latency.

Why two lanes: the whole step's host work then sits between steps. Before a step its lane's attention
outputs (computed during the step before) go to the device in one copy; inside the step the attention op
only copies rows between device buffers at fixed addresses (so whole-step CUDA graphs capture it, as for
GPU-only decode); after the step the staged q/k/v of every layer go to the host in one copy and one job on
the CPU worker appends and attends all layers, during the next step. The job is one C++ call that waits for
pinned counters the GPU stream raises behind those copies, so from its inputs' arrival to its end it needs no
GIL; it writes a lane's pinned output only after that buffer's last copy to the device (the guard). On a
CPU-only run the job runs at once.
"""
import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

from apex_compile.config import TuningConfig
from apex_compile.kernels._common import INTERPRET
from apex_compile.kernels.stagger import WAIT_TIMEOUT_S, exchange_rows, exchange_rows_waiting, raise_flag, swap_rows
from apex_compile.ops.cpu_attention import StaggerRunner, stagger_cpu_job, wait_host_flags
from apex_compile.runtime.kv_manager import HOST_POOL, KVManager
from apex_compile.runtime.request import Request
from apex_compile.runtime.sampler import host_wait_event

ROPE_KINDS = ("cos", "sin")
LANES = 2  # lanes taking turns by default (1: one lane whose layers wait on the device, `LayerJobs`)
EMA = 0.2  # weight of the newest measurement in the adaptive pipeline's running averages
FIT_EMA = 0.05  # decay per job of the weighted sums the job-time fit (fixed + rate x work) uses: ~20 jobs of memory
FIT_SPREAD = 0.1  # the fit's slope is taken only from jobs whose work spreads by this share of its mean (a ramp)
WAIT_SHARE = 0.05  # above this running share of a step spent waiting for the CPU job, rows are taken away
REGROW_STEPS = 16  # steps without waiting for the CPU before a row taken away comes back
# The job fit's rate stays within this factor of the performance model's CPU rate (profiled at bandwidth, when
# there is a profile): a draining pipeline's small jobs, mostly per-call costs, once read as a CPU 3-6x slower
# and the rows collapsed for good; a flat noisy fit read as a nearly free CPU whose fixed part took the step.
# A CPU really slower than the profile's (another process) is caught by the waits (the guard).
PRIOR_SPREAD = 1.5
# (The adaptive rows fit the one-lane layered job's work, its team's thread-seconds inside work items over the
# team's threads, not its running time: that also counts threads waiting for a layer's flag while the GPU paces
# the job, so a job with slack would read as costly as a full one. The guard still cuts rows that make the GPU wait.)
# Steps an empty pipeline waits before it drops its measured rows' evidence (a probe: one row more, auto's model
# decides); the wait doubles after each probe, up to MAX_IDLE_HOLD. Without jobs nothing else moves the
# limits, so one bad stretch (a fill's contention) would otherwise stop the host rows for good.
IDLE_HOLD = 256
MAX_IDLE_HOLD = 16384


class RowLimit:
    """How many rows of a lane's turn hold requests (beyond it, requests wait to rejoin), where the pipeline adapts
    it: the most whose CPU job fits in `job_share` of a step, from a running fit of the job's seconds as a fixed part
    plus a rate per (layer, context token) (the slope from jobs of different work, as a filling pipeline runs; the
    fixed part keeps the job's per-call costs from reading as per-row ones) and a running average of the step
    (measured without the launching thread's wait for the job, so a CPU that falls behind does not loosen its own
    limit). A guard against a fit that flatters the CPU (a slower host than the fit's jobs showed): each step in
    which the launching thread waits for the job more than WAIT_SHARE of the step, as it has on average lately,
    takes a row away, then lets the waits of one `cycle` pass (a row taken away shortens the job only as the
    lanes' groups re-enter under the new limit, `cycle` steps; one per waiting step would take every row before
    the first cut acts); one comes back after REGROW_STEPS steps without such a wait. With the performance
    model's CPU rate (`prior_rate`) the fit's rate is kept within PRIOR_SPREAD of it. The step average takes
    decode steps only (a step with prompt chunks, hundreds of them while a pipeline fills, would widen the budget
    of the decode steps that follow). An empty pipeline drops that evidence after `IDLE_HOLD` steps
    (`idle_step`). A fixed pipeline keeps every row. The fitted rows need not be whole: the groups of a cycle
    take the floor or the ceiling of them in turn (`turn_rows`), each step's job covering every group."""

    def __init__(self, width: int, num_layers: int, adaptive: bool, prior_rate: Optional[float] = None,
                 cycle: Optional[int] = None, job_share: float = TuningConfig.job_share):
        """prior_rate: the profiled seconds per (layer, context token) of the CPU attention, or None. cycle: steps
        until every group re-entered under a new limit (lanes x (num_layers + 1); default one lane's). job_share:
        the share of a step the CPU job keeps within (`TuningConfig.job_share`)."""
        self.width = width
        self.job_share = job_share
        self.cycle = num_layers + 1 if cycle is None else cycle
        self.prior_rate = prior_rate
        self.num_layers = num_layers
        self.adaptive = adaptive
        self.measured = width  # rows whose CPU job fits a step (adaptive; else the width)
        self.ceiling = width  # rows the performance model says pay (offload="auto"; else the width)
        self.limit = width  # min(measured, ceiling): the whole rows every turn takes (`turn_rows` adds the rest)
        # the measured rows before rounding down (the budget over a row's seconds, within the guard): the groups
        # share them out (`turn_rows`), so a job that fits 4.6 rows runs 4.6 a step on average, not 4
        self.fraction = float(width)
        self.rate: Optional[float] = None  # seconds per (layer, context token) of the CPU job beyond its fixed part
        self.fixed = 0.0  # seconds of a job that do not grow with its work
        self.step: Optional[float] = None  # seconds per step
        self.wait_share: Optional[float] = None  # running share of a step the launching thread waited for the job
        self.guard = width  # rows allowed by the waits for the CPU job (the guard in the class docstring)
        self._calm_steps = 0  # steps since the last one that waited too long
        self._cooldown = 0  # steps left before the guard may take another row (its last cut is taking effect)
        self._moments: Optional[List[float]] = None  # weighted sums of 1, work, seconds, work^2, work x seconds
        self._context = 0.0  # the last mean context `update` saw (an empty pipeline keeps it)
        self.idle_steps = 0  # steps with an empty pipeline since it emptied or last probed
        self.idle_hold = IDLE_HOLD  # idle steps before the next probe (doubles after each)
        self.probes = 0

    @staticmethod
    def _average(old: Optional[float], new: float) -> float:
        return new if old is None else (1 - EMA) * old + EMA * new

    def observe_job(self, seconds: float, work: int, decode: bool = True) -> None:
        """A job's run time and its work: the context tokens it attended, summed over its rows (one layer each).
        decode: False for a job of a turn with prompt chunks, left out like its step (`observe_step`): it ran
        beside the prompts' K/V export into the host cache, so its time tells nothing of its rows' cost."""
        if work <= 0 or not decode:
            return
        x = float(work)
        values = (1.0, x, seconds, x * x, x * seconds)  # exponentially weighted sums (the first: the weights)
        if self._moments is None:
            self._moments = list(values)
        else:
            self._moments = [(1 - FIT_EMA) * m + v for m, v in zip(self._moments, values)]
        weight = self._moments[0]
        mean_x, mean_y, mean_xx, mean_xy = (m / weight for m in self._moments[1:])
        proportional = mean_y / mean_x
        variance = mean_xx - mean_x * mean_x
        if variance > (FIT_SPREAD * mean_x) ** 2:
            # a slope above the per-work average would mean a negative fixed part (noise, contention): capped
            self.rate = min(max((mean_xy - mean_x * mean_y) / variance, 0.1 * proportional), proportional)
        elif self.rate is None:
            self.rate = proportional
        if self.prior_rate:
            self.rate = min(max(self.rate, self.prior_rate / PRIOR_SPREAD), self.prior_rate * PRIOR_SPREAD)
        self.fixed = min(max(mean_y - self.rate * mean_x, 0.0), mean_y)

    def observe_step(self, seconds: float, waited: float = 0.0, decode: bool = True,
                     in_use: Optional[float] = None) -> None:
        """A step's seconds without the launching thread's wait for the CPU job, and that wait; decode: False for
        a step with prompt chunks or just after one, which neither its length nor its wait tells about: the CPU job
        then also waits for the prompts' K/V on their way into the host cache, and that wait, not the job's rows,
        holds the GPU. in_use: the rows the job's groups held on average (None: unknown); a step without a wait
        counts towards a row back only if they reached the guard: a pipeline draining under a ceiling of 0 shows
        nothing about the rows that made the GPU wait (regrown, they would refill it at those rows)."""
        self.idle_steps = 0
        if seconds > 0 and decode:
            self.step = self._average(self.step, seconds)
            share = waited / (seconds + waited)
            self.wait_share = self._average(self.wait_share, share)
            self._cooldown = max(self._cooldown - 1, 0)
            if share > WAIT_SHARE and self.wait_share > WAIT_SHARE:  # this step waited, and it is no one-off
                if not self._cooldown:
                    self.guard = max(1, min(self.guard, math.ceil(self.share())) - 1)
                    self._cooldown = self.cycle
                self._calm_steps = 0
            elif in_use is None or in_use + 0.5 >= self.guard:
                self._calm_steps += 1
                if self._calm_steps >= REGROW_STEPS and self.guard < self.width:
                    self.guard += 1
                    self._calm_steps = 0

    def row_seconds(self, context: Optional[float] = None) -> Optional[float]:
        """The fitted job's seconds per row of a full lane (each row at every layer once) of `context`-token
        requests (None: the last mean context); None before a fit."""
        context = self._context if context is None else context
        if self.rate is None or context <= 0:
            return None
        return self.rate * self.num_layers * context

    @property
    def context(self) -> float:
        """The mean context of the job's rows at the last turn that had any (0 before one): a host request gains a
        token per lanes x (num_layers + 1) steps, so it lags the device rows' context."""
        return self._context

    def job_fit(self) -> Optional[Tuple[float, float]]:
        """The fitted job as (fixed seconds, seconds per context token of a row over every layer); None before a
        fit."""
        return None if self.rate is None else (self.fixed, self.rate * self.num_layers)

    def job_seconds(self, rows: float) -> Optional[float]:
        """The fitted CPU job of a full lane with `rows` rows per layer at the last mean context (None before
        a fit)."""
        per_row = self.row_seconds()
        return None if per_row is None else self.fixed + rows * per_row

    def set_ceiling(self, rows: int) -> None:
        """The performance model's rows (0..width; 0: no request enters the pipeline)."""
        self.ceiling = max(0, min(self.width, rows))
        self.limit = min(self.measured, self.ceiling)

    def idle_step(self) -> None:
        """A step with no request in the pipeline: after `idle_hold` of them, if the measured rows are below the
        width, the evidence behind them (the job fit, the guard) is dropped as stale and one row more than measured
        is allowed (the guard; auto's model decides whether they pay). One row a probe bounds what a failed probe
        costs: the host prompts of the requests it admits, parked again. Measured rows at the width are no
        probe."""
        if not self.adaptive or self.measured >= self.width:
            return
        self.idle_steps += 1
        if self.idle_steps >= self.idle_hold:
            self.idle_steps = 0
            self.idle_hold = min(2 * self.idle_hold, MAX_IDLE_HOLD)
            self.probes += 1
            self.guard = self.measured = min(self.width, self.measured + 1)
            self.rate, self.fixed, self._moments = None, 0.0, None
            self._calm_steps = self._cooldown = 0
            self.update(0.0)

    def update(self, mean_context: float) -> int:
        """The limit for requests of `mean_context` tokens (0: the last seen; the measured part unchanged until
        both averages exist)."""
        if mean_context > 0:
            self._context = mean_context
        per_row = self.row_seconds()
        if self.adaptive and per_row is not None and self.step is not None:
            budget = self.job_share * self.step - self.fixed
            self.fraction = max(1.0, min(float(self.width), budget / per_row, float(self.guard)))
            self.measured = int(self.fraction)
        else:
            self.fraction = float(self.measured)
        self.limit = min(self.measured, self.ceiling)
        return self.limit

    def share(self) -> float:
        """Rows a turn holds on average: the measured rows unrounded, or the model's ceiling where it is below
        them (a ceiling at the measured whole rows is the model taking every row it was offered: `fits`)."""
        return self.fraction if self.ceiling >= self.measured else float(self.ceiling)

    def turn_rows(self, slot: int) -> int:
        """The rows of the group at `slot` (0 .. groups - 1) of a lane's cycle: `share` spread over the groups
        (floor or ceiling of it), so that any `groups` consecutive slots hold `capacity_rows(groups)` rows. A
        group keeps its size while the share holds, and the job's work per step (every group, one layer each)
        stays even."""
        x = self.share()
        return math.floor((slot + 1) * x + 1e-9) - math.floor(slot * x + 1e-9)

    def capacity_rows(self, groups: int) -> int:
        """Rows of `groups` groups of one lane (`turn_rows` summed over a cycle)."""
        return math.floor(groups * self.share() + 1e-9)


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
    """The lanes of the staggered plan, their device-side row state and the CPU jobs (module docstring)."""

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
        # offload="auto": closed to new requests, its members finishing (`Engine._update_stagger_ceiling`)
        self.closed = False
        self.evicted = 0  # requests sent back to wait in `joining` by a fallen row limit (begin_step)
        self.stalled = 0  # turns a member waited in `joining` for a host block for its next token (begin_step)
        self.keep_free = 0  # host blocks a member's growth leaves free (the scheduler's room to park into)
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
        evicted, used, stalled = [], 0, set()
        for row, r in enumerate(entering):
            if r is None:
                continue
            if used < limit and self._has_block(r):
                used += 1
            else:
                if used < limit:
                    stalled.add(r.request_id)
                entering[row] = None
                evicted.append(r)
        self.inside -= len(evicted)
        self.joining.extendleft(reversed(evicted))
        self.evicted += len(evicted) - len(stalled)
        # free rows take joining requests in order, passing over those without a block for their next token
        free_rows = collections.deque(row for row in range(self.width) if entering[row] is None)
        passed = []
        while free_rows and used < limit and self.joining:
            r = self.joining.popleft()
            if not self._has_block(r):
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
        # and the engine parks them (`Engine._park_idle_pipeline`)
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


ABORTED = 1 << 62  # a failed layered job's done flags: the device waits pass at once (the engine raises its error)


class LayerJobs:
    """The one-lane plan's CPU jobs: one per turn on a C++ worker thread (`StaggerRunner`, pinned like `AsyncJobs`'
    worker, over `caches`: the host pool's per-layer key and value caches), appending and attending layer by layer
    as the GPU step stages the layers. A job needs no GIL to start, return or hand over its timings: jobs are
    queued with `submit`, and their timings reach this object when the launching thread next calls `collect`,
    `launch` or `submit` (and a job's `observe` callback then). The device
    reads and writes host buffers directly (pinned on a GPU): every layer's staged q/k/v and outputs, and per layer two
    counters, `ready` (raised by the step behind its staging of the layer) and `done` (raised by the job once it
    wrote the layer's outputs; the next step's layer waits for it on the device). `stalls`: each layer's last
    device wait (ns on a GPU); `status`: a turn whose device wait timed out. A job that fails raises every done
    flag to ABORTED, so the GPU goes on (its block rows wrong) and the next `collect` or `launch` raises."""

    def __init__(self, staged: torch.Tensor, outputs: torch.Tensor,
                 caches: Tuple[List[torch.Tensor], List[torch.Tensor]], pin_memory: bool = True,
                 threads: Optional[int] = None):
        layers = staged.shape[0]
        self.staged = torch.zeros(staged.shape, dtype=staged.dtype, pin_memory=pin_memory)
        self.outputs = torch.zeros(outputs.shape, dtype=outputs.dtype, pin_memory=pin_memory)
        counters = torch.zeros(3 * layers + 1, dtype=torch.int64, pin_memory=pin_memory)
        self.ready, self.done = counters[:layers], counters[layers:2 * layers]
        self.stalls, self.status = counters[2 * layers:3 * layers], counters[3 * layers:]
        self._stalls, self._status = self.stalls.numpy(), self.status.numpy()  # read each step: no torch op
        self.stall_unit = 1e-9 if pin_memory else 0.0  # seconds per unit of `stalls` (polls under the interpreter)
        self.cores = worker_cores(threads)
        self.runner = StaggerRunner(caches[0], caches[1], self.cores)
        self._observers: Dict[int, object] = {}  # submitted turn -> its observe(waited, ran, busy) callback
        self._gates: Dict[int, Tuple[torch.Tensor, int]] = {}  # submitted turn -> its gate (counter, value)
        # recent timings, seconds: (waiting for the layers' flags, running) per job, and per step the device's
        # waits for the CPU (how far the CPU is behind the GPU), as AsyncJobs' collect waits
        self.job_seconds: Deque[Tuple[float, float]] = collections.deque(maxlen=4096)
        self.collect_seconds: Deque[float] = collections.deque(maxlen=4096)
        # per job, the team's thread-seconds inside work items; over the running time x len(cores), the share of
        # the team that was working, not waiting between items
        self.job_busy: Deque[float] = collections.deque(maxlen=4096)
        # per job (perf_counter seconds): submitted, started on the worker, ended: the worker's time between jobs
        self.job_times: Deque[Tuple[float, float, float]] = collections.deque(maxlen=4096)
        # per job with rows, seconds: waiting for prompt exports before the call, the C++ call beyond its waits and
        # running (checks, plans, frees), the Python call beyond the C++ one (glue, the GIL taken back)
        self.job_parts: Deque[Tuple[float, float, float]] = collections.deque(maxlen=4096)
        # the last jobs' timelines for a timed-out device wait's error (the state when it is read may be long past
        # the stall): (turn, submitted, started, ended, gate wait, flags wait, running), perf_counter seconds
        self._timelines: Deque[Tuple[int, float, float, float, float, float, float]] = collections.deque(maxlen=3)
        self._last_submit: Optional[Tuple[int, float]] = None  # (turn, perf_counter) of the last job queued
        self.gate_state: Optional[Callable[[], str]] = None  # where what the jobs' gates wait for stands (exports)

    def _raise_errors(self) -> None:
        """Takes the C++ runner's finished jobs' records; raises a finished job's error, or a device wait that timed
        out."""
        for record in self.runner.poll():
            self._record(*record)
        if self._status[0]:
            raise RuntimeError(f"the GPU waited more than {WAIT_TIMEOUT_S:.0f} s for the staggered CPU job of turn "
                               f"{int(self._status[0])}: the CPU worker is stuck or gone ({self.stuck_state()})")

    def stuck_state(self) -> str:
        """Where the jobs stand, for the error of a device wait that timed out: the layers' flags (ready: raised by
        the steps' staging; done: by the jobs), and what the worker is doing (the C++ runner's phase and the turn in
        it, with that job's gate)."""
        ready, done = self.ready.tolist(), self.done.tolist()
        told = [f"ready flags {min(ready)}..{max(ready)}, done flags {min(done)}..{max(done)}"]
        if self.stall_unit:  # the device's last wait per layer: a clock that jumped would show here too
            layer = int(self._stalls.argmax())
            longest = self._stalls[layer] * self.stall_unit
            told.append(f"the device's longest last wait {longest:.1f} s, at layer {layer}")
        state = self.runner.state()
        told.append(f"runner: {state['submitted']} job(s) submitted, {state['queued']} queued, {state['finished']} "
                    f"finished, {state['phase']}" + (f" (turn {state['turn']})" if state["turn"] is not None else ""))
        gate = self._gates.get(state["turn"])
        if gate is not None:
            told.append(f"its gate {int(gate[0][0])} of {gate[1]}")
        now = time.perf_counter()
        if self._last_submit is not None:
            told.append(f"the last job queued: turn {self._last_submit[0]}, {now - self._last_submit[1]:.1f} s ago")
        for turn, submitted, started, ended, gate_wait, waited, ran in self._timelines:
            told.append(f"turn {turn}: queued {now - submitted:.1f} s ago, started {started - submitted:.3f} s "
                        f"later, its gate {gate_wait:.3f} s, the layers' flags {waited:.3f} s, running {ran:.3f} s, "
                        f"ended {now - ended:.1f} s ago")
        if self.gate_state is not None:
            told.append(self.gate_state())
        return "; ".join(told)

    def _record(self, turn, waited, ran, busy, call, gate_wait, submitted, started, ended) -> None:
        """A C++ runner job's record (StaggerRunner.RECORD_FIELDS) into the timings."""
        self.job_times.append((submitted, started, ended))
        self._timelines.append((int(turn), submitted, started, ended, gate_wait, waited, ran))
        self._gates.pop(int(turn), None)
        observe = self._observers.pop(int(turn), None)
        if observe is None or ran != ran:  # a turn without rows, or a failed job (its error was raised by `poll`)
            return
        self.job_seconds.append((waited, ran))
        # exports waited for, the C++ call beyond its waits and running, the rest of the runner's time on the job
        self.job_parts.append((gate_wait, call - waited - ran, max(ended - started - gate_wait - call, 0.0)))
        self.job_busy.append(busy)
        observe(waited, ran, busy)

    def submit(self, turn: int, observe, **job) -> None:
        """Queues `turn`'s job on the C++ runner: the layer-by-layer job (`stagger_layer_job`) over the staged
        rows into the outputs with these flags, `job` naming its other arguments (cache_index, block_tables,
        context_lens, slot_mapping, rows, num_heads, scale; gate and gate_value: what it waits for before it
        starts); observe(waited, ran, busy) is called with its timings once it is done."""
        self._raise_errors()
        self._last_submit = (int(turn), time.perf_counter())
        self._observers[int(turn)] = observe
        if job.get("gate") is not None:
            self._gates[int(turn)] = (job["gate"], int(job["gate_value"]))
        self.runner.submit(turn, self.outputs, self.ready, self.done, staged=self.staged, **job)

    def launch(self, turn: int, job, inputs: List[torch.Tensor], output: torch.Tensor) -> None:
        """A turn without rows (`job` None): its done flags rise as soon as the jobs before it are done.
        inputs / output: unused (the device reads and writes the host buffers itself)."""
        self._raise_errors()
        self._last_submit = (int(turn), time.perf_counter())
        if job is not None:
            raise RuntimeError("LayerJobs takes jobs by `submit`, not as Python callables")
        self.runner.submit(turn, self.outputs, self.ready, self.done)

    def collect(self, key: int, out: torch.Tensor) -> None:
        """Before a step: raises a failed job's error; records the device's waits of the last steps' layers."""
        self._raise_errors()
        self.collect_seconds.append(float(self._stalls.sum()) * self.stall_unit)

    def drain(self) -> None:
        """Waits for every launched job (their steps are queued: each job's flags come)."""
        self.runner.drain()
        self._raise_errors()

    def close(self) -> None:
        """Stops the worker once its queued jobs are done."""
        self.runner.close()
        self._observers.clear()
        self._gates.clear()


class SyncJobs:
    """CPU-only run: a job runs when launched; its output is handed out by the next `collect` of its key.
    A job is called as job(*inputs, out, ready_flags, ready_values) (`AsyncJobs`; nothing to wait for here)
    and writes its rows of `out` (shaped like `output`)."""

    def __init__(self):
        self.results: Dict[int, Optional[torch.Tensor]] = {}
        self.buffers: Dict[int, torch.Tensor] = {}

    def launch(self, key: int, job, inputs: List[torch.Tensor], output: torch.Tensor) -> None:
        if job is None:
            self.results[key] = None
            return
        out = self.buffers.get(key)
        if out is None or out.shape != output.shape:
            out = self.buffers[key] = torch.zeros(output.shape, dtype=output.dtype)
        job(*inputs, out, None, ())
        self.results[key] = out

    def collect(self, key: int, out: torch.Tensor) -> None:
        result = self.results.pop(key, None)
        if result is None:
            out.zero_()
        else:
            out.copy_(result)

    def drain(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        self.results.clear()
        self.buffers.clear()


class CudaCopies:
    """The copies of `AsyncJobs` on CUDA, both on the compute stream (so the next step's writes to the staged
    device buffers come after their copy out): inputs to pinned staging, outputs back. Each staging is followed
    on the stream by a raise of a pinned counter (`flags`) that a CPU job polls in C++ without the GIL; one
    stream completes its work in order, so the counter's value says every copy queued before it is done,
    copies back included: a copy back is done once the next staging's raise is seen (no raise of its own in
    the host gap before a step). Each returns (flag index, value)."""

    def __init__(self, device: torch.device):
        self.device = device
        # [0]: raised by the stream behind each staging
        self.flags = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._device_flag = torch.zeros(1, dtype=torch.int64, device=device)
        self._raised = 0

    def stage(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[int, int]:
        """Copies each (pinned dst, device src) after the work queued so far."""
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        self._raised += 1
        self._device_flag.fill_(self._raised)
        self.flags[:1].copy_(self._device_flag, non_blocking=True)
        return 0, self._raised

    def restore(self, dst: torch.Tensor, src: torch.Tensor) -> Tuple[int, int]:
        """Copies the pinned `src` into the device `dst`."""
        dst.copy_(src, non_blocking=True)
        return 0, self._raised + 1  # the next staging comes after it on the stream


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


class LauncherPin:
    """Keeps the threads that launch GPU work (those calling `ensure`) on the cores the CPU attention worker
    leaves free, so that the worker's OpenMP team does not share a core with the launcher (or its hyperthread
    sibling's load) while a step's host work runs; each pinned thread gets its affinity back on `release`.
    Nothing happens where no core is left free (a worker on every core) or affinity cannot be set."""

    def __init__(self, worker: List[int]):
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        busy = set(worker)
        self.cores = [c for c in allowed if c not in busy]
        self._pinned: Dict[int, set] = {}  # native thread id -> its affinity before

    def ensure(self) -> None:
        if not self.cores:
            return
        tid = threading.get_native_id()
        if tid not in self._pinned:
            self._pinned[tid] = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cores)

    def release(self) -> None:
        for tid, cores in self._pinned.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # that thread has ended
                pass
        self._pinned.clear()


class AsyncJobs:
    """Asynchronous CPU jobs, one in flight per key (a lane): `launch` stages the inputs into pinned buffers
    (`copies.stage`) and a worker thread runs the job into the key's pinned output buffer; the key's next
    `collect` waits for it and copies the output to the device (`copies.restore`). A job is called as
    job(*staged, out, ready_flags, ready_values) and must touch neither before ready_flags[i] >=
    ready_values[i] for every i (`wait_host_flags`; the engine's job waits in its C++ call): its inputs are
    staged and the output buffer's last copy to the device is done (the guard). It returns (seconds waiting,
    seconds running)."""

    def __init__(self, copies, pin_memory: bool = True, threads: Optional[int] = None):
        """threads: the worker's OpenMP threads, pinned to the last `threads` cores this process may use (None:
        all of them but the first, left to the thread that launches GPU work)."""
        self.copies = copies
        self.pin_memory = pin_memory
        self.cores = worker_cores(threads)
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="apex-stagger",
                                                            initializer=_pin_worker, initargs=(self.cores,))
        self.buffers: Dict[tuple, torch.Tensor] = {}
        self.guards: Dict[int, Tuple[int, int]] = {}  # key -> (flag, value) of its output buffer's last copy back
        self.pending: Dict[int, Optional[concurrent.futures.Future]] = {}
        # recent timings, seconds: (waiting for the inputs' copy and the guard, running the job) per job, and
        # the launching thread's wait in each collect (how far the CPU is behind the GPU)
        self.job_seconds: Deque[Tuple[float, float]] = collections.deque(maxlen=4096)
        self.collect_seconds: Deque[float] = collections.deque(maxlen=4096)

    def _buffer(self, name: str, key: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get((name, key))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.buffers[(name, key)] = torch.zeros(like.shape, dtype=like.dtype, pin_memory=self.pin_memory)
        return buf

    def launch(self, key: int, job, inputs: List[torch.Tensor], output: torch.Tensor) -> None:
        """Stages `inputs` and runs the job on the worker; its out is pinned, shaped like `output` (the device
        buffer the key's next `collect` fills)."""
        if job is None:
            self.pending[key] = None
            return
        staged = [self._buffer(f"in{i}", key, t) for i, t in enumerate(inputs)]
        values = [0] * len(self.copies.flags)
        flag, value = self.copies.stage(list(zip(staged, inputs)))
        values[flag] = value
        guard = self.guards.get(key)
        if guard is not None:
            values[guard[0]] = max(values[guard[0]], guard[1])
        out_buf = self._buffer("out", key, output)
        flags = self.copies.flags

        def run():
            with torch.inference_mode():
                self.job_seconds.append(job(*staged, out_buf, flags, tuple(values)))

        self.pending[key] = self.worker.submit(run)

    def collect(self, key: int, out: torch.Tensor) -> None:
        future = self.pending.pop(key, None)
        if future is None:
            out.zero_()
            self.collect_seconds.append(0.0)
            return
        start = time.perf_counter()
        future.result()
        self.collect_seconds.append(time.perf_counter() - start)
        self.guards[key] = self.copies.restore(out, self.buffers[("out", key)])

    def drain(self) -> None:
        """Waits for every launched job (before their requests' blocks are freed)."""
        for future in self.pending.values():
            if future is not None:
                future.result()

    def close(self) -> None:
        """Stops the worker thread once its queued jobs are done (their outputs are dropped); frees the buffers."""
        self.pending = {}
        self.worker.shutdown(wait=True)
        self.buffers.clear()
        self.guards.clear()

"""`Plan`: what an offload plan decides in the engine's step loop, and `make_plan`, which picks one.

The engine (`runtime/engine.py`) runs the loop: schedule, launch, queue ahead, resolve. Everything that differs
between where host-pool requests attend lives behind this interface:
- construction: `host_policy` and `pipeline` for the scheduler, `block_width` (step-buffer rows ahead of the
  chunks), `build_graphs` / `build_steps` (the plan's CUDA graphs and compiled steps);
- before a step: `enter_step` (thread placement), `gap_sample` / `observe_gap` (auto's host gap),
  `before_schedule` (the plan's control loop, every step), `begin_step` (a step scheduled now, not queued ahead);
- the step: `lead_rows` / `lead_sampling_rows` / `lead_input_rows` (rows the plan puts ahead of the scheduler's
  chunks), `forward` (which graph runs it), `after_launch` (host work once the forward and the sampling are
  queued), `took_token` (where a request that got a token decodes next), `observe_step` (a decode step's time),
  `ahead_graphs` (the graphs a step queued ahead would replay);
- lifetime: `capture_graphs`, `warmup`, `captured_seconds`, `close`.
Defaults here are those of a plan with no rows of its own ahead of the chunks and no control loop.
"""
import abc
import contextlib
from typing import List, Tuple

import torch

from apex_compile.runtime.kv_manager import HOST_POOL
from apex_compile.runtime.request import Request


class Plan(abc.ABC):
    """One offload plan of an engine: its graphs, compiled steps, worker threads and control loop."""

    name = "plan"
    host_policy = None  # offload="auto"'s `AutoOffload` when the scheduler admits host requests by its model
    pipeline = None  # the staggered plan's `StaggerPipeline` (None for the other plans)
    block_width = 0  # step-buffer rows the plan keeps ahead of the scheduler's chunks (its widest lead)
    graphs = None  # whole decode-step graphs per capture size (`DecodeGraphs`), None without CUDA graphs

    def __init__(self, engine):
        self.engine = engine

    # ----------------------------------------------------------------------------------------------------
    # construction

    @property
    def overlap(self) -> bool:
        """Whether compiled graphs split attention into launch / device / wait."""
        return False

    @abc.abstractmethod
    def build_graphs(self, max_rows: int) -> None:
        """Makes the plan's graph containers for steps of up to `max_rows` scheduled rows (CUDA graphs on)."""

    @abc.abstractmethod
    def build_steps(self) -> None:
        """Builds the plan's step functions (compiled once per model and options, shared across engines)."""

    def attach(self, scheduler) -> None:
        """The engine's scheduler exists (it is built from the plan's `host_policy` and `pipeline`)."""

    # ----------------------------------------------------------------------------------------------------
    # around a step

    def enter_step(self) -> None:
        """Start of `Engine.step()`, before its timer starts."""

    def gap_sample(self):
        """What `observe_gap` needs of the step about to run, or None when it teaches nothing."""
        return None

    def observe_gap(self, sample, seconds: float) -> None:
        """A decode-only step's wall time, with its `gap_sample`."""

    def before_schedule(self) -> None:
        """Every step, before it is scheduled or taken from the queued-ahead step: the plan's control loop."""

    def begin_step(self) -> None:
        """A step about to be scheduled now (not queued ahead), before the scheduler runs."""

    def lead_rows(self) -> int:
        """Rows this step runs ahead of the scheduler's chunks (0: none; a step with lead rows may have no chunk)."""
        return 0

    def lead_sampling_rows(self) -> List[Tuple[int, Request]]:
        """(row, request) of the lead rows whose next token this step samples."""
        return []

    def lead_input_rows(self) -> List[Tuple[int, Request]]:
        """(row, request) of the lead rows whose input id a step queued ahead takes from the sampled ids."""
        return []

    @abc.abstractmethod
    def forward(self, chunks, logit_rows: List[int], device_ids=None) -> torch.Tensor:
        """Queues the step's forward over the chunks (after the lead rows) and returns the logits of
        `logit_rows`; device_ids: input ids already on the device (a step queued before the host has them)."""

    def after_launch(self, lead_sampled: List[Tuple[int, Request]]) -> None:
        """Once the forward and the choice of its tokens are queued: `lead_sampled` are the lead rows sampled."""

    def took_token(self, request: Request) -> None:
        """A request outside the lead rows got a token and goes on."""

    def observe_step(self, chunks, start: float) -> None:
        """A decode step scheduled at `start` (perf_counter) whose tokens are in, no graph captured in it."""

    def ahead_graphs(self):
        """The whole-step graphs a step queued ahead would replay (None: it runs uncaptured)."""
        return self.graphs

    # ----------------------------------------------------------------------------------------------------
    # graphs and lifetime

    def capture_graphs(self, progress: bool = True) -> None:
        """Captures the whole decode-step graphs of every capture size."""

    def warmup(self) -> None:
        """After `Engine.warmup`'s runs: the plan's graphs and compiled steps a run would meet."""

    def captured_seconds(self) -> float:
        """Seconds spent so far capturing graphs lazily."""
        return 0.0

    def close(self) -> None:
        """Stops the plan's threads and releases what it holds; the engine frees pools and buffers after."""

    def _quiet(self, active):
        """Context of a capture or compile run of a step with lead rows (none here)."""
        return contextlib.nullcontext()


def typical_contexts(engine) -> List[int]:
    """Contexts at which offload="auto" asks its model whether host requests pay."""
    return sorted({min(c, engine.max_model_len) for c in (256, 1024, 4096)})


def make_plan(engine) -> Plan:
    """The engine's plan from `ApexConfig.offload` and, for "auto", its performance model:
    - staggered: offload="staggered" with a host pool, or "auto" where the model predicts the pipeline gains;
    - overlap: host-pool requests in the batch (offload="all", a fraction, or "auto" admitting host requests);
    - GPU-only: otherwise (offload="never", "auto" where no host plan pays, every CPU-only "auto" run).
    The engine's `kv`, `config`, `auto_policy` and `calibration` must exist."""
    from apex_compile.runtime.plans.gpu_only import GpuOnlyPlan
    from apex_compile.runtime.plans.overlap import OverlapPlan
    from apex_compile.runtime.plans.staggered import DEFAULT_STAGGER_WIDTH, StaggeredPlan

    config = engine.config
    if config.offload == "staggered" and engine.kv.pools[HOST_POOL].num_blocks:
        return StaggeredPlan(engine, config.stagger_width or DEFAULT_STAGGER_WIDTH)
    if engine.auto_policy is not None and StaggeredPlan.pays(engine):
        # auto's plan: the model's ceiling (each step) and the measured CPU job (each turn) set the rows
        return StaggeredPlan(engine, config.stagger_width or "auto")
    host_policy = OverlapPlan.auto_host_policy(engine)
    if host_policy is not None or config.host_fraction() > 0.0:
        return OverlapPlan(engine, host_policy)
    return GpuOnlyPlan(engine)

"""The engine: requests in, tokens out, one flattened forward step at a time.

Each step the scheduler picks chunks; the engine flattens them into input_ids / position_ids [1, T] in the
runner's token order, prepares the runner's metadata once, and runs the model's step
`step(input_ids, position_ids, logits_indices) -> logits [N, vocab]` (compiled with the "apex" backend, whose
attention ops call the runner) inside `with attention_runner(runner)`. The sampler picks the next token of
every request whose chunk reached its last token; stop conditions are checked; finished requests return
their blocks.
"""
import contextlib
import dataclasses
import math
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from apex_compile.config import GiB, ApexConfig
from apex_compile.kernels.paged_attention import reserve_decode_counters
from apex_compile.ops.kv_layout import to_device
from apex_compile.runtime.attention_runner import PagedAttentionRunner, order_chunks
from apex_compile.runtime.context import attention_runner
from apex_compile.runtime.cuda_graphs import (PIECEWISE_MAX_TOKENS, DecodeGraphs, MixedGraphs, PiecewiseGraphs,
                                              capture_sizes, piecewise_sizes)
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, POOL_NAMES, CacheShape, KVManager
from apex_compile.runtime.perf_model import AutoOffload, PerfModel, StepCalibration
from apex_compile.runtime.request import Request, RequestStatus, SamplingParams
from apex_compile.runtime.sampler import PendingTokens, Sampler
from apex_compile.runtime.scheduler import ScheduledChunk, Scheduler
from apex_compile.runtime.stagger import LauncherPin, StaggerPipeline, rope_tables
from apex_compile.runtime.step_buffers import DeviceIds, StepBuffers

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
EAGER_ATTENTION_NAME = "apex_paged"
_PROGRESS_MIN_TOKENS = 4096  # default progress bar only for runs generating at least this many tokens
DEFAULT_STAGGER_WIDTH = 4  # offload="staggered" without a width
# offload="auto": steps in a row the model must find host rows paying before a ceiling of 0 rises (an empty
# pipeline's first requests are prefilled in the host pool, costly; a verdict flickering at the margin would pay
# that and park them again)
STAGGER_RISE_STEPS = 64
# and steps in a row it must find none paying before a pipeline with members closes (its members finish on the
# host) or, if no rows beat GPU-only, its ceiling falls to 0 (which empties it: its requests are parked, and
# refilling it takes a rise and a lane's cycle; a dip of the measured rows, the job fit's noise, read as a verdict
# of 0 for one step)
STAGGER_FALL_STEPS = 32
_FRONT_LOCK = threading.Lock()  # makes an engine's run lock and asynchronous front once (`Engine.front`)


@dataclasses.dataclass
class TokenEvent:
    """One generated token of request `index` (the position of its prompt in the `generate` call)."""

    index: int
    token_id: int
    text: str  # newly decoded text ("" without a tokenizer, or while a multi-byte character is incomplete)
    finish_reason: Optional[str]  # None while the request goes on


@dataclasses.dataclass
class Completion:
    """The result of one prompt."""

    index: int
    prompt_token_ids: List[int]
    token_ids: List[int]
    text: Optional[str]
    finish_reason: str
    steps_per_pool: dict  # {"device": steps, "host": steps} this request ran in each pool
    num_preemptions: int


PHASES = ("schedule", "prepare", "forward", "pipeline", "wait", "finish")


@dataclasses.dataclass
class EngineStats:
    """Counters of the engine since it was built (or since `reset`)."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_seconds: float = 0.0
    requests_per_pool: List[int] = dataclasses.field(default_factory=lambda: [0, 0])
    moved: int = 0
    parked: int = 0
    recomputed: int = 0
    migrated: int = 0  # pipeline members moved to the device pool
    ahead_steps: int = 0  # steps queued before the previous step's tokens reached the host (async scheduling)
    # why a step was not queued ahead, per reason (`Engine._ahead_chunks`): each such step leaves the GPU idle while
    # the host schedules and prepares it
    not_ahead: Dict[str, int] = dataclasses.field(default_factory=dict)
    # the main thread's time per part of `step()`, seconds: schedule (the pipeline's begin when not begun
    # earlier, the scheduler), prepare (step buffers, their copy, the CPU job's outputs), forward (queuing the
    # graphs or running the step), pipeline (the staggered block's host work behind it), wait (for the sampled
    # ids: where the GPU sets the pace), finish (stop checks, the scheduler's updates)
    phase_seconds: Dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def as_dict(self) -> dict:
        """Plain dict for printing / JSON."""
        out = dataclasses.asdict(self)
        out["requests_per_pool"] = dict(zip(POOL_NAMES, self.requests_per_pool))
        return out


def _rows_of(logits: torch.Tensor, rows: List[int]) -> torch.Tensor:
    """logits[rows] of a whole-step graph's output: a slice when the rows are 0..n-1, else a gather (its index
    copied without stalling the host: a staggered block with empty rows, before the pipeline is full)."""
    if rows == list(range(len(rows))):
        return logits[:len(rows)]
    return logits.index_select(0, to_device(rows, torch.long, logits.device))


@dataclasses.dataclass
class _Launched:
    """A step queued on the device whose sampled ids the host has not taken yet."""

    sampled: List[Request]  # the requests whose next token the step chooses, in logits-row order
    pending: Optional[PendingTokens]
    in_pipeline: set  # ids of the staggered block's requests among them
    ahead: bool = False  # queued before the previous step's tokens came back (async scheduling)


def check_supported(hf_model: torch.nn.Module) -> None:
    """Raises a clear error unless `hf_model` is a decoder-only LLaMA-family HF causal LM the engine handles."""
    config = getattr(hf_model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None:
        raise TypeError(f"apex_compile.optimize expects a HuggingFace causal LM (PreTrainedModel), got "
                        f"{type(hf_model).__name__}")
    get_head = getattr(hf_model, "get_output_embeddings", None)
    if get_head is None or get_head() is None or not hasattr(hf_model, "generation_config"):
        raise TypeError(f"{type(hf_model).__name__} has no language-model head: apex_compile.optimize needs the "
                        f"causal LM (e.g. LlamaForCausalLM), not the bare decoder")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model type {model_type!r} ({type(hf_model).__name__}): apex_compile "
                         f"supports the LLaMA-family decoders {SUPPORTED_MODEL_TYPES}")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("unsupported model: encoder-decoder models are not LLaMA-family decoders")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise ValueError(f"unsupported model: sliding-window attention (window {window}) is not implemented by "
                         f"the paged kernels")


def _eager_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface function: routes a layer's attention to the step's runner (eager mode)."""
    from apex_compile.runtime.context import get_attention_runner

    out = get_attention_runner().attention(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                           value[0].transpose(0, 1), scaling)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def _attn_implementation(config, name: str):
    """Sets config._attn_implementation for one forward and restores the user's setting afterwards."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def host_memory_available() -> Optional[int]:
    """Bytes of host memory available for new allocations (/proc/meminfo's MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _model_step(model: torch.nn.Module) -> Callable:
    """step(input_ids [1, T], position_ids [1, T], logits_indices [N]) -> logits [N, vocab] of `model`."""

    def step(input_ids, position_ids, logits_indices):
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_indices)
        return out.logits[0]

    # a code object of its own: dynamo keeps its graphs (and counts them against RECOMPILE_LIMIT) per code object,
    # which every closure of this function would otherwise share across models and engines
    step.__code__ = step.__code__.replace()
    return step


_COMPILED_ATTR = "_apex_compiled_steps"
RECOMPILE_LIMIT = 64  # graphs per step code object (one per model step): 0/1-size specialisations x options


def _compiled_step(model: torch.nn.Module, overlap: bool, inner: Optional[str], stagger: bool = False):
    """(compiled step, list receiving its pass reports) for `model` with these apex backend options.

    On a CPU the fusions stay off: the fused ops' CPU implementations are the aten ops HF runs, behind a custom-op
    call that costs more than it saves (~60 such calls per step for a 30-layer model); an eagerly run graph's
    fp32 linears use oneDNN packed weights instead (`apex_compile.passes.pack_linear`).

    Kept on the model (a private attribute) and shared by every engine of that model: compiling costs far more
    than a step, and the graph reads no engine state (the runner comes from the context).
    """
    per_model = model.__dict__.setdefault(_COMPILED_ATTR, {})
    key = (overlap, inner, stagger)
    if key not in per_model:
        from apex_compile.backend import apex_backend

        reports: list = []
        on_cpu = next(model.parameters()).device.type == "cpu"
        if not on_cpu:  # one GEMM per layer for q/k/v (and gate/up): their weights back to back in one buffer
            from apex_compile.ops.linear import merge_projection_weights

            merge_projection_weights(model)
        options = {"attention": "paged", "overlap": overlap, "fuse": not on_cpu, "fuse_qkv": not on_cpu,
                   "pack_linear": on_cpu and inner in (None, "eager"), "stagger": stagger,
                   "on_report": reports.append}
        if inner is not None:
            options["inner"] = inner
        compiled = torch.compile(_model_step(model), backend=apex_backend, dynamic=True, options=options)
        if inner == "inductor" and next(model.parameters()).device.type == "cpu":
            compiled = _with_frozen_weights(compiled)
        per_model[key] = (compiled, reports)
    return per_model[key]


def _with_frozen_weights(compiled: Callable) -> Callable:
    """Runs `compiled` with inductor's weight freezing on: on CPU, linear layers become oneDNN calls on
    pre-packed weights (about twice as fast as ATen's GEMM at decode batch sizes). The weights are read when
    a graph compiles: later changes to them are not seen."""
    from torch._inductor import config as inductor_config

    def run(*args):
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return run


class Engine:
    """Continuous-batching generation over paged device + host KV pools for one HF model."""

    def __init__(self, hf_model: torch.nn.Module, config: Optional[ApexConfig] = None, tokenizer=None):
        check_supported(hf_model)
        self.model = hf_model
        self.config = config or ApexConfig()
        self.tokenizer = tokenizer
        model_config = hf_model.config
        param = next(hf_model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        positions = getattr(model_config, "max_position_embeddings", None)
        if self.config.max_model_len is not None and positions is not None and self.config.max_model_len > positions:
            raise ValueError(f"ApexConfig.max_model_len={self.config.max_model_len} is beyond the model's "
                             f"max_position_embeddings={positions}: positions past it were never trained; use "
                             f"max_model_len <= {positions} (or None for {positions})")
        self.max_model_len = self.config.max_model_len or positions
        num_heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // num_heads
        self.shape = CacheShape(model_config.num_hidden_layers,
                                getattr(model_config, "num_key_value_heads", None) or num_heads, head_dim,
                                self.config.block_size, self.dtype)
        device_bytes, host_bytes = self._pool_bytes()
        block_bytes = self.shape.block_bytes
        self.kv = KVManager(self.shape, device_bytes // block_bytes, host_bytes // block_bytes, self.device)
        # replays of this engine's captured decode graphs (filled at capture): the performance model's step
        self.calibration = StepCalibration()
        self.auto_policy: Optional[AutoOffload] = None  # offload="auto"'s model (CUDA with a host pool)
        # the staggered plan's lanes: one on CUDA (its layers wait on the device, so half the requests are in
        # flight for the same rows), two on a CPU
        self.stagger_lanes = self.config.stagger_lanes or (1 if self.device.type == "cuda" else 2)
        if (self.config.offload == "auto" and self.device.type == "cuda" and self.config.compile
                and self.kv.pools[HOST_POOL].num_blocks):
            from apex_compile.runtime.perf_profile import engine_profile

            self.auto_policy = AutoOffload(PerfModel(engine_profile(self), self.calibration),
                                           stagger_groups=self.stagger_lanes * (self.shape.num_layers + 1),
                                           max_stagger_rows=self.config.tuning.auto_stagger_width)
        self.stagger: Optional[StaggerPipeline] = None
        self._pipeline_due = False  # a staggered forward was queued and its `_advance_pipeline` not yet run
        self._async = self.config.async_scheduling
        if self._async is None:
            self._async = self.device.type == "cuda"
        self._ahead: Optional[_Launched] = None  # the step queued ahead by the last `step()`, not yet resolved
        self._closed = False
        self._last_tick: Optional[float] = None  # inside `step()`: the time of its last phase tick
        if self.config.offload == "staggered" and self.kv.pools[HOST_POOL].num_blocks:
            self.stagger = self._stagger_pipeline(self.config.stagger_width or DEFAULT_STAGGER_WIDTH)
        elif self.auto_policy is not None and self._auto_stagger_pays():
            # auto's plan: the model's ceiling (each step) and the measured CPU job (each turn) set the rows
            self.stagger = self._stagger_pipeline(self.config.stagger_width or "auto")
        # the threads that call step() kept off the CPU attention worker's cores (a CUDA worker only)
        cores = getattr(getattr(self.stagger, "executor", None), "cores", None)
        pin = bool(self.config.pin_launcher)  # off by default (ApexConfig.pin_launcher)
        self._launcher = LauncherPin(cores) if cores and self.device.type == "cuda" and pin else None
        self._ceiling_key = None  # (device rows, context bucket, calibration state) of the last auto ceiling
        self._decode_only = False  # whether the last step() only decoded (no prompt chunk, no graph captured)
        self._verdicts = {}  # the model's host rows at that key, per margin ("rise", "keep", "hold")
        self._model_rows = 0  # the last of them asked (e2e_hybrid records it)
        self._rise_steps = 0  # steps in a row the model's rows were > 0 while the ceiling stayed 0
        self._fall_steps = 0  # steps in a row the model's rows were 0 while the ceiling of a used pipeline was not
        self.scheduler = Scheduler(self.config, self.kv, self.max_model_len, self._auto_host_policy(), self.stagger)
        self.runner = PagedAttentionRunner(self.kv, self.device)
        self.runner.stagger = self.stagger
        max_rows = max(self.config.max_num_batched_tokens, self.config.max_num_seqs, 2)
        width = self.stagger.width if self.stagger is not None else 0
        self.buffers = StepBuffers(self.kv, max_rows + width, self.max_model_len, self.device)
        self.graphs: Optional[DecodeGraphs] = None
        self.pieces: Optional[PiecewiseGraphs] = None
        self.stagger_pieces: Optional[PiecewiseGraphs] = None
        self.stagger_graphs: Optional[DecodeGraphs] = None
        self.mixed: Optional[MixedGraphs] = None  # whole graphs of mixed steps (the staggered ones with the block)
        self.stagger_mixed: Optional[MixedGraphs] = None
        if self.device.type == "cuda" and self.config.cuda_graphs and self.config.compile:
            # the decode kernel's split counters at the largest launch's size, before any capture
            reserve_decode_counters(self.device, (max_rows + width) * self.shape.num_kv_heads)
            sizes = self.config.capture_sizes or capture_sizes(min(self.config.max_num_seqs,
                                                                   self.config.max_num_batched_tokens))
            self.graphs = DecodeGraphs([n for n in sizes if n <= max_rows])
            pieces_rows = min(max_rows, PIECEWISE_MAX_TOKENS)
            self.pieces = PiecewiseGraphs(piecewise_sizes(pieces_rows), pieces_rows, torch.cuda.graph_pool_handle())
            if self.stagger is not None:  # the staggered graph's pieces (their rows include the block)
                rows = min(max_rows + width, PIECEWISE_MAX_TOKENS)
                self.stagger_pieces = PiecewiseGraphs(piecewise_sizes(rows), rows, self.pieces.pool)
                self.stagger_graphs = DecodeGraphs([n for n in sizes if n <= max_rows])
            if self.config.mixed_graphs:  # every step size: a whole graph's launch is one call at any size
                self.mixed = MixedGraphs(piecewise_sizes(max_rows), self.pieces.pool)
                if self.stagger is not None:
                    self.stagger_mixed = MixedGraphs(piecewise_sizes(max_rows + width), self.pieces.pool)
        self.sampler = Sampler()
        self.reports: list = []  # pass reports of the compiled step's graphs
        self.stats = EngineStats()
        self._next_id = 0
        self._step_fn = self._build_step()
        self._stagger_step_fn = self._build_step(stagger=True) if self.stagger is not None else None

    def _stagger_pipeline(self, width) -> StaggerPipeline:
        """The staggered plan's pipeline of `width` rows per step, or "auto": `TuningConfig.auto_stagger_width`
        rows, those in
        use following the measured CPU job (the compiled step is needed: its passes swap the rows per layer)."""
        adaptive = width == "auto"
        width = self.config.tuning.auto_stagger_width if adaptive else width
        if not self.config.compile:
            raise ValueError("offload='staggered' needs ApexConfig(compile=True): the staggered rows are swapped "
                             "per layer by the compiler's passes")
        config = self.model.config
        # the profiled CPU rate bounds the adaptive rows' job fit (auto has a profile)
        prior = self.auto_policy.model.cpu_seconds_per_token() / self.shape.num_layers if self.auto_policy else None
        return StaggerPipeline(self.kv, width, config.hidden_size, config.num_attention_heads,
                               rope_tables(self.model, self.max_model_len), self.device, self.dtype,
                               self.max_model_len, self.config.cpu_attention_threads, adaptive, prior,
                               lanes=self.stagger_lanes, job_share=self.config.tuning.job_share)

    def _typical_contexts(self) -> List[int]:
        return sorted({min(c, self.max_model_len) for c in (256, 1024, 4096)})

    def _auto_stagger_pays(self) -> bool:
        """offload="auto": whether the model predicts the staggered plan gains for some typical load."""
        width = self.config.stagger_width
        width = self.config.tuning.auto_stagger_width if width in (None, "auto") else width
        tokens = [p.num_blocks * self.kv.block_size for p in self.kv.pools]
        return self.auto_policy.worth_staggering(tokens[DEVICE_POOL], tokens[HOST_POOL], self.config.max_num_seqs,
                                                 self._typical_contexts(), width)

    def _update_stagger_ceiling(self) -> None:
        """offload="auto" with the staggered plan, before a step: the host rows per step that the (calibrated)
        model predicts best beside the running device-pool requests, among the rows the measured CPU job fits;
        0 when none beats GPU-only, so that no request enters the pipeline (those inside leave it as they
        sample, parked to resume in the device pool: `_park_idle_pipeline`): a plan whose job fits fewer rows
        than its overhead needs to pay stops taking requests. Recomputed when the composition or the measured
        rows change; a ceiling of 0 rises only after the model has found rows paying STAGGER_RISE_STEPS steps in
        a row (`AutoOffload.stagger_rows`, its margin), and a pipeline with members stops only after
        STAGGER_FALL_STEPS steps of none (its keep margin, `keep=True`). Stopping first closes it
        (`StaggerPipeline.closed`): no request joins, its members finish at the rows that still beat GPU-only
        (`hold=True`), rather than all parked at once to resume in the device pool; the keep verdict back opens
        it again, and its ceiling falls to 0 once it is empty or after STAGGER_FALL_STEPS steps of no rows
        beating GPU-only. The model adds each kind of step's host gap, learned from this engine's decode steps
        (`step`, `_gap_sample`), and predicts the CPU job by the pipeline's measured job fit once there is one
        (`AutoOffload.learn_cpu_job`)."""
        running = self.scheduler.running
        if not running:
            return
        stagger = self.stagger
        device = [r for r in running if self.kv.pool_of(r.request_id) == DEVICE_POOL]
        context = sum(r.num_tokens for r in running) / len(running)
        host_context = stagger.rows.context or None  # the job's rows' own context (they lag the device rows')
        fits = min(stagger.width, stagger.rows.measured)
        used = bool(stagger.rows.ceiling and stagger.num_members)  # a running pipeline: the lower keep margin
        gap = self.auto_policy.gap
        fit = stagger.rows.job_fit()  # the measured job (kept until an idle probe drops it): not the profile's
        self.auto_policy.learn_cpu_job(fit)
        key = (len(device), int(context) // 32, int(host_context or 0) // 32, len(self.calibration.rows),
               self.calibration.stagger_width, fits,
               round(gap.seconds(False) * 1e4), round(gap.seconds(True) * 1e4),  # gaps in 0.1 ms
               fit and (round(fit[0] * 1e4), round(math.log(max(fit[1], 1e-15)) * 50)))  # rate in 2% steps

        def verdict(margin: str) -> int:  # the model's rows at that margin ("rise", "keep", "hold"), cached by key
            if self._ceiling_key != key:
                self._ceiling_key, self._verdicts = key, {}
            if margin not in self._verdicts:
                self._verdicts[margin] = self.auto_policy.stagger_rows(
                    len(device), context, fits, keep=margin != "rise", host_context=host_context,
                    hold=margin == "hold")
            self._model_rows = self._verdicts[margin]
            return self._model_rows

        rows = verdict("keep" if used else "rise")
        if stagger.closed and not stagger.num_members:  # a closed pipeline emptied: GPU-only until a rise
            stagger.closed = False
            stagger.rows.set_ceiling(0)
            return
        if rows and not stagger.rows.ceiling:  # rising from 0: only once the verdict has held STAGGER_RISE_STEPS
            self._rise_steps += 1
            if self._rise_steps < STAGGER_RISE_STEPS:
                return
        self._rise_steps = 0
        if rows or not used:
            self._fall_steps = 0
            stagger.closed = False
            stagger.rows.set_ceiling(rows)
            return
        held = verdict("hold")  # a used pipeline the keep verdict does not pay: the rows that still beat GPU-only
        if not stagger.closed:  # an open one closes after STAGGER_FALL_STEPS, or empties if none beat it
            self._fall_steps += 1
            if self._fall_steps < STAGGER_FALL_STEPS:
                return
            self._fall_steps = 0
            stagger.closed = bool(held)
            stagger.rows.set_ceiling(held)
            return
        if held:
            self._fall_steps = 0
            stagger.rows.set_ceiling(held)
            return
        self._fall_steps += 1  # a closed one empties (its members parked) after STAGGER_FALL_STEPS of none
        if self._fall_steps >= STAGGER_FALL_STEPS:
            self._fall_steps = 0
            stagger.closed = False
            stagger.rows.set_ceiling(0)

    def _park_idle_pipeline(self) -> None:
        """A staggered pipeline whose ceiling is 0 (offload="auto": host rows no longer pay) empties as its
        requests sample (`_row_limit`); once none is inside, those waiting to rejoin are parked (with their host
        KV) so that they resume in the device pool, rather than keeping every step staggered for a row each.
        Only requests whose last token the host has (a step queued ahead may still be sampling the others')."""
        stagger = self.stagger
        if stagger.rows.ceiling or stagger.inside or not stagger.joining:
            return
        ready = [r.request_id for r in stagger.joining if r.num_computed < r.num_tokens]
        if not ready:
            return
        stagger.executor.drain()  # nothing may still read their blocks as they shrink (no job holds them now)
        for request in stagger.remove(ready):
            self.scheduler.park_from_pipeline(request)

    def _migrate_to_device(self) -> None:
        """Pipeline members move to the device pool where it has room for them: there a member gains a token per
        step instead of one per lanes x (layers + 1) steps, and PCIe moves its KV in milliseconds. Members with the
        most tokens left go first (those nearly done finish as soon where they are). A marked member leaves at its
        next token boundary (`StaggerPipeline.leaving`); once its token is on the host it is parked with its host
        KV and resumes in the device pool ahead of waiting requests (`Scheduler.schedule`)."""
        stagger, scheduler, kv = self.stagger, self.scheduler, self.kv
        ready = [r.request_id for r in stagger.joining
                 if r.request_id in stagger.leaving and r.num_computed < r.num_tokens]
        if ready:
            stagger.executor.drain()  # nothing may still read their blocks as they move
            for request in stagger.remove(ready):
                scheduler.park_from_pipeline(request)
                scheduler.to_device.add(request.request_id)
                self.stats.migrated += 1
        members = stagger.members()
        leaving = [r for r in members if r.request_id in stagger.leaving]
        slots = self.config.max_num_seqs - len(scheduler.running) - len(scheduler.parked) - len(leaving)
        if slots <= 0:
            return

        def need(request) -> int:  # its whole table in the device pool, and its growth reserve
            return kv.blocks_for(scheduler._reserve_target(request))

        room = (kv.num_free(DEVICE_POOL) + kv.num_held(DEVICE_POOL)
                - scheduler._running_need(lookahead=scheduler._parks_ahead(), reserve=True)
                - sum(need(r) for r in list(scheduler.parked) + leaving))
        rest = lambda r: scheduler.max_tokens(r) - r.num_tokens  # noqa: E731
        for request in sorted((r for r in members if r.request_id not in stagger.leaving), key=rest, reverse=True):
            if slots <= 0 or need(request) > room:
                break
            stagger.leaving.add(request.request_id)
            room -= need(request)
            slots -= 1

    def _auto_host_policy(self) -> Optional[AutoOffload]:
        """The auto policy if its model predicts that host requests pay for some typical load, else None (then
        the host pool only parks swapped-out requests and the overlapped graph is never compiled)."""
        policy = self.auto_policy
        if policy is None or self.stagger is not None:
            return None
        tokens = [p.num_blocks * self.kv.block_size for p in self.kv.pools]
        return policy if policy.worth_enabling(tokens[DEVICE_POOL], tokens[HOST_POOL], self.config.max_num_seqs,
                                               self._typical_contexts()) else None

    def _pool_bytes(self):
        """(device pool bytes, host pool bytes) from the config, defaults filled in."""
        device_bytes = self.config.gpu_cache_size
        if device_bytes is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                device_bytes = int(0.8 * free)
            else:
                device_bytes = GiB
        host_bytes = GiB if self.config.cpu_cache_size is None else self.config.cpu_cache_size
        available = host_memory_available()
        host_total = host_bytes + (device_bytes if self.device.type != "cuda" else 0)
        if available is not None and host_total > available:
            what = ("cpu_cache_size" if self.device.type == "cuda"
                    else "gpu_cache_size + cpu_cache_size (on a CPU both pools are host RAM)")
            raise ValueError(f"the KV pools do not fit: {what} = {host_total / GiB:.2f} GiB "
                             f"({host_total} bytes) but only {available / GiB:.2f} GiB ({available} bytes) of host "
                             f"memory is available (MemAvailable); choose at most that, leaving room for the "
                             f"model and activations")
        if self.device.type == "cuda" and self.config.gpu_cache_size is not None:
            free, _ = torch.cuda.mem_get_info(self.device)
            if device_bytes > free:
                raise ValueError(f"the device KV pool does not fit: gpu_cache_size = {device_bytes / GiB:.2f} GiB "
                                 f"({device_bytes} bytes) but only {free / GiB:.2f} GiB ({free} bytes) of CUDA "
                                 f"memory is free on {self.device}; choose at most that (None: 80% of it)")
        return device_bytes, host_bytes

    @property
    def overlap(self) -> bool:
        """Whether compiled graphs split attention into launch / device / wait (CUDA with host-pool requests)."""
        return self.device.type == "cuda" and HOST_POOL in self.scheduler.run_pools and self.stagger is None

    def _build_step(self, stagger: bool = False) -> Callable:
        """The step function: compiled with the apex backend, or eager HF modules with attention routed here."""
        model = self.model
        if not self.config.compile:
            from transformers import AttentionInterface

            AttentionInterface.register(EAGER_ATTENTION_NAME, _eager_paged_attention)
            forward = _model_step(model)
            # on a CPU the fp32 linears run on oneDNN-packed weights, as in the compiled graph (no trace needed)
            packed = self.device.type == "cpu" and pack_linear.available()

            def eager_step(input_ids, position_ids, logits_indices):
                with (_attn_implementation(model.config, EAGER_ATTENTION_NAME),
                      pack_linear.PackedLinears() if packed else contextlib.nullcontext()):
                    return forward(input_ids, position_ids, logits_indices)

            return eager_step
        compiled, reports = _compiled_step(model, self.overlap, self.config.inner, stagger)
        if not stagger:
            self.reports = reports
        # Past dynamo's recompile limit it would run the unrewritten HF forward, which attends over the step's
        # tokens only: a silently wrong result. Each model step has its own code object (`_model_step`), so the
        # limit counts one step's shapes; past it, an error instead of the fallback.
        # specialize_float: the model's float attributes (RMSNorm eps, attention scaling) are constants; as
        # symbolic inputs, SDPA's scale guard made AOT autograd restart dynamo's analysis after its cache lookup,
        # so every fresh process traced the graph twice and its first AOT trace was thrown away, never cached.
        dynamo_limits = {key: value for key, value in (("recompile_limit", RECOMPILE_LIMIT),
                                                       ("fail_on_recompile_limit_hit", True),
                                                       ("specialize_float", True))
                         if hasattr(torch._dynamo.config, key)}

        def compiled_step(input_ids, position_ids, logits_indices):
            with _attn_implementation(model.config, "sdpa"), torch._dynamo.config.patch(**dynamo_limits):
                return compiled(input_ids, position_ids, logits_indices)

        return compiled_step

    # ----------------------------------------------------------------------------------------------------
    # requests

    def add_request(self, prompt_token_ids: Sequence[int], sampling: Optional[SamplingParams] = None) -> Request:
        """Validates and queues one prompt; raises before any work if it is empty, too long or cannot fit."""
        return self._enqueue(self._new_request(prompt_token_ids, sampling or SamplingParams()))

    def _enqueue(self, request: Request) -> Request:
        """Queues a validated request under the next id."""
        request.request_id = self._next_id
        self.scheduler.add(request)
        self._next_id += 1
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        return request

    def _new_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> Request:
        """A validated Request with the next id (not queued); raises on an empty, too long or unfitting prompt."""
        self._check_open()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens is too long: the model's maximum length is "
                             f"{self.max_model_len} tokens (prompt + at least one generated token)")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass one to apex_compile.optimize(..., tokenizer=...)")
        if sampling.eos_token_ids is None:  # the model's EOS, resolved here (a user's SamplingParams stops at it)
            sampling = dataclasses.replace(sampling, eos_token_ids=self.model_eos_token_ids())
        request = Request(self._next_id, prompt, sampling)
        self.scheduler.check_fits(request)
        return request

    def has_unfinished(self) -> bool:
        """Whether any request is not finished."""
        return not self._closed and self.scheduler.has_unfinished()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed (Engine.close() freed its KV pools and graphs): build a "
                               "new one with apex_compile.optimize(model)")

    def close(self) -> None:
        """Frees what this engine holds: cancels its requests, stops its worker threads and drops its KV pools,
        step buffers, CUDA graphs and compiled steps, so that another engine can take the memory (torch's
        caching allocators keep it for reuse: `torch.cuda.empty_cache()` returns the device's). A second call
        does nothing; any other use afterwards raises RuntimeError."""
        if self._closed:
            return
        self._stop_front()  # (request-level API below) its thread makes no engine call after this
        try:
            self.abort()
        finally:
            self._ahead = None
            self._closed = True
            try:
                if self._launcher is not None:
                    self._launcher.release()
                if self.stagger is not None:
                    self.stagger.close()
            finally:
                self.runner.close()
                self.kv.close()
                for name in ("kv", "scheduler", "runner", "stagger", "buffers", "graphs", "pieces", "stagger_graphs",
                             "stagger_pieces", "mixed", "stagger_mixed", "auto_policy", "_step_fn",
                             "_stagger_step_fn"):
                    setattr(self, name, None)

    def _stop_reason(self, request: Request) -> Optional[str]:
        last = request.output_token_ids[-1]
        sampling = request.sampling
        if sampling.eos_token_ids and last in sampling.eos_token_ids:
            return "eos"
        if sampling.stop_strings:
            text = self.tokenizer.decode(request.output_token_ids)
            hits = [text.find(s) for s in sampling.stop_strings if s in text]
            if hits:
                request.output_text = text[:min(hits)]
                return "stop"
        if self._at_length(request):
            return "length"
        return None

    def _at_length(self, request: Request, pending: int = 0) -> bool:
        """Whether the request is at its length limit (max_new_tokens, max_model_len) with `pending` more tokens
        (sampled, not yet on the host)."""
        return (len(request.output_token_ids) + pending >= request.sampling.max_new_tokens
                or request.num_tokens + pending >= self.max_model_len)

    # ----------------------------------------------------------------------------------------------------
    # one step

    def _schedule(self) -> List[ScheduledChunk]:
        """The scheduler's next chunks in the runner's token order."""
        plan = self.scheduler.schedule()  # (host blocks a move reads or frees wait for their exports: settle_host)
        if not plan.chunks and not (self.stagger is not None and self.stagger.active):
            raise RuntimeError("scheduler found nothing to run although requests are pending")
        self.stats.moved += len(plan.moved)
        self.stats.parked += len(plan.parked)
        self.stats.recomputed += len(plan.recomputed)
        for chunk in plan.chunks:
            if chunk.request.steps_per_pool[chunk.pool] == 1:
                self.stats.requests_per_pool[chunk.pool] += 1
        self.kv.wait_for_moves()
        return order_chunks(plan.chunks)

    def _graph_size(self, chunks: List[ScheduledChunk]) -> Optional[int]:
        """The capture size whose graph runs this step, or None (not a decode-only step of the device pool)."""
        if self.graphs is None or any(c.pool != DEVICE_POOL or not c.decodes for c in chunks):
            return None
        return self.graphs.size_for(len(chunks))

    def _logits_rows(self, count: int) -> int:
        """Rows of the LM-head GEMM for `count` wanted rows (repeated rows are computed and dropped): on CUDA at
        least two, since dynamo specialises size-0/1 dimensions and each specialisation would compile the whole
        model again (on a CPU the graph runs eagerly and a recompile is cheap)."""
        return max(count, 2) if self.device.type == "cuda" else max(count, 1)

    def _run_model(self, parts, num_rows: int, num_logits: int, runner=None, stagger_rows: int = 0) -> torch.Tensor:
        """The compiled step over the buffers' first `num_rows` rows, attention served by `runner` (default: the
        engine's runner, given the step's parts); with `stagger_rows`, the staggered graph, its block first."""
        self.runner.set_parts(parts, num_rows, stagger_rows)
        input_ids, position_ids, indices = self.buffers.inputs(num_rows, num_logits)
        step_fn = self._stagger_step_fn if stagger_rows else self._step_fn
        with attention_runner(runner or self.runner), torch.inference_mode():
            return step_fn(input_ids, position_ids, indices)

    def capture_graphs(self, progress: bool = True) -> None:
        """Captures the decode CUDA graphs of every capture size (done by `warmup`, else at the first decode)."""
        if self.graphs is None or self.graphs.ready:
            return
        padded = {}

        def prepare(size):
            padded[size] = self.buffers.fill([], [], pad_to=size)
            self.buffers.copy_to_device()

        self.graphs.capture(prepare, lambda size: self._run_model(*padded[size], size), progress, self.pieces.pool)
        self.calibration.rows, self.calibration.step_s = self.graphs.time_replays()

    def _capture_pieces(self, key, stagger_rows: int = 0) -> None:
        """Captures the piecewise graphs of (rows, logits rows) `key` over a step of padding rows only (with
        `stagger_rows`, the staggered graph's, its residual rows left as they were)."""
        rows, num_logits = key
        parts, _ = self.buffers.fill([], [], pad_to=rows - stagger_rows, first_row=stagger_rows)
        if stagger_rows:  # the block's rows and every logits row within the step (fill wrote rows - block of them)
            self.buffers.ids[:stagger_rows], self.buffers.positions[:stagger_rows] = 0, 0
            self.buffers.logits_indices[:num_logits] = np.arange(num_logits) % rows
        self.buffers.copy_to_device()
        pieces = self.stagger_pieces if stagger_rows else self.pieces

        def forward(runner):
            return self._run_model(parts, rows, num_logits, runner, stagger_rows)

        with torch.inference_mode(), self._quiet_stagger(stagger_rows):
            pieces.capture(key, self.runner, forward)

    def _mixed_key(self, chunks: List[ScheduledChunk], num_tokens: int, num_logits: int,
                   stagger_rows: int = 0):
        """The key of the whole mixed graph that runs this step (capturing it the first time), or None: no
        mixed graphs, a chunk outside the device pool, too many prompt chunks, or too many rows."""
        graphs = self.stagger_mixed if stagger_rows else self.mixed
        if graphs is None or not StepBuffers.mixed_fits(chunks):
            return None
        key = graphs.key_for(num_tokens, num_logits)
        if key is not None and key not in graphs.graphs:
            rows, padded_logits = key
            parts, _ = self.buffers.fill([], [], first_row=stagger_rows, mixed_rows=rows - stagger_rows)
            if stagger_rows:
                self.buffers.ids[:stagger_rows], self.buffers.positions[:stagger_rows] = 0, 0
            self.buffers.logits_indices[:padded_logits] = np.arange(padded_logits) % rows
            self.buffers.copy_to_device()
            with torch.inference_mode(), self._quiet_stagger(stagger_rows):
                graphs.capture(key, lambda: self._run_model(parts, rows, padded_logits,
                                                            stagger_rows=stagger_rows))
        return key

    def _captured_seconds(self) -> float:
        """Seconds spent so far capturing graphs lazily (piecewise and mixed)."""
        return sum(g.capture_seconds for g in (self.pieces, self.stagger_pieces, self.mixed, self.stagger_mixed)
                   if g is not None)

    @contextlib.contextmanager
    def _quiet_stagger(self, active: bool):
        """While graphs of the staggered step are captured: their uncaptured runs leave the pipeline as it was
        (`StaggerPipeline.quiet`)."""
        if not active:
            yield
            return
        with self.stagger.quiet():
            yield

    def _fill_staggered(self, chunks, logit_rows, pad_to=None, total_rows=None):
        """StepBuffers.fill for a step led by the staggered block; a whole graph's step (pad_to) computes the
        logits of every row."""
        width = self.stagger.width
        parts, num_rows = self.buffers.fill(chunks, logit_rows, pad_to=pad_to, total_rows=total_rows,
                                            first_row=width)
        if pad_to is not None:
            self.buffers.logits_indices[:num_rows] = np.arange(num_rows)
        return parts, num_rows

    def capture_stagger_graphs(self, progress: bool = True) -> None:
        """Captures the whole-step graphs of staggered decode steps (the block and padded device decode rows),
        every capture size (done by `warmup`, else at the first such step)."""
        graphs = self.stagger_graphs
        if graphs is None or graphs.ready:
            return
        width = self.stagger.width
        padded = {}

        def prepare(size):
            padded[size] = self._fill_staggered([], [], pad_to=size)[0]
            self.buffers.ids[:width], self.buffers.positions[:width] = 0, 0
            self.buffers.copy_to_device()

        def forward(size):
            return self._run_model(padded[size], width + size, width + size, stagger_rows=width)

        with self._quiet_stagger(True):
            graphs.capture(prepare, forward, progress, self.pieces.pool)
            rows, seconds = graphs.time_replays()
        self.calibration.stagger_rows, self.calibration.stagger_s = rows, seconds
        self.calibration.stagger_width = width

    def _forward_staggered(self, chunks: List[ScheduledChunk], logit_rows: List[int],
                           device_ids: Optional[DeviceIds] = None) -> torch.Tensor:
        """`_forward_chunks` of a step led by the staggered block: a whole-step graph when the device rows all
        decode, a whole mixed graph when they hold prompt chunks that fit its layout (`MixedGraphs`), else the
        staggered graph in pieces or (without CUDA graphs, above their sizes) as compiled.
        The block's host work is done after the forward is queued: `end_step` (this step's q/k/v to the CPU),
        then the next step's `begin_step`; only `collect` (the CPU's outputs to the device) comes before it."""
        stagger = self.stagger
        self._advance_pipeline()  # a caller that skipped it (nothing does): the lanes stay in order anyway
        width = stagger.width
        num_tokens = width + sum(c.num_tokens for c in chunks)
        size = None
        if self.stagger_graphs is not None and all(c.pool == DEVICE_POOL and c.decodes for c in chunks):
            size = self.stagger_graphs.size_for(max(len(chunks), 1))
            if size is not None and not self.stagger_graphs.ready:
                self.capture_stagger_graphs()
        pieces = self.stagger_pieces
        mixed = self._mixed_key(chunks, num_tokens, len(logit_rows), width) if size is None else None
        key = (pieces.key_for(num_tokens, len(logit_rows)) if pieces is not None and size is None and mixed is None
               else None)
        if key is not None and key not in pieces.pieces:
            self._capture_pieces(key, width)
        num_logits = len(logit_rows)
        if size is None:
            padded = mixed or key
            padded_logits = padded[1] if padded is not None else self._logits_rows(num_logits)
            padded_rows = (logit_rows + [num_tokens - 1] * padded_logits)[:padded_logits]
        else:
            padded_rows = logit_rows
        if mixed is not None:
            parts, num_rows = self.buffers.fill(chunks, padded_rows, first_row=width, mixed_rows=mixed[0] - width)
        else:
            parts, num_rows = self._fill_staggered(chunks, padded_rows, pad_to=size, total_rows=key and key[0])
        self.buffers.ids[:width] = stagger.input_ids()  # (0 where the token is still on its way: device_ids)
        self.buffers.positions[:width] = stagger.groups[0].positions
        self.buffers.copy_to_device(device_ids)
        stagger.collect()
        start = self._tick("prepare")
        self.runner.set_parts(parts, num_rows, width)
        if size is not None:
            logits = _rows_of(self.stagger_graphs.replay(size), logit_rows)
        elif mixed is not None:
            logits = self.stagger_mixed.replay(mixed)[:num_logits]
        elif key is not None:
            with torch.inference_mode():
                logits = pieces.replay(key, self.runner)[:num_logits]
        else:
            logits = self._run_model(parts, num_rows, len(padded_rows), stagger_rows=width)[:num_logits]
        self._pipeline_due = True  # `_advance_pipeline`, once the caller queued what it wants before it
        self.stats.forward_seconds += self._tick("forward") - start
        self.stats.steps += 1
        for chunk in chunks:
            chunk.request.num_computed += chunk.num_tokens
        return logits

    def _advance_pipeline(self) -> None:
        """After a staggered forward is queued (and the sampled ids' copy behind it): `end_step` (this step's
        q/k/v to the CPU job), then the next step's `begin_step`, host work done while the GPU runs the step;
        their device copies queue behind the sampled ids, so the host gets its tokens without waiting for them."""
        if not self._pipeline_due:
            return
        self._pipeline_due = False
        stagger = self.stagger
        stagger.end_step(self.runner)
        if stagger.num_members:
            stagger.begin_step()
        self._tick("pipeline")

    def _forward_chunks(self, chunks: List[ScheduledChunk], logit_rows: List[int],
                        device_ids: Optional[DeviceIds] = None) -> torch.Tensor:
        """Runs the model on the chunks (flattened in order) and returns the logits of `logit_rows`: a whole
        decode graph, a whole mixed graph (prompt chunks, every row in the device pool), piecewise graphs (host
        rows), or (without CUDA graphs) the compiled step itself. device_ids: input ids already on the device
        (a step queued before the host has them)."""
        if self.stagger is not None and any(not c.decodes for c in chunks):
            self.stagger.note_prompt_step()  # the row limit leaves this step out of its decode-step measures
        if self.stagger is not None and self.stagger.active:
            return self._forward_staggered(chunks, logit_rows, device_ids)
        size = self._graph_size(chunks)
        if size is not None and not self.graphs.ready:
            self.capture_graphs()
        num_tokens = sum(c.num_tokens for c in chunks)
        mixed = self._mixed_key(chunks, num_tokens, len(logit_rows)) if size is None else None
        key = (self.pieces.key_for(num_tokens, len(logit_rows))
               if size is None and mixed is None and self.pieces is not None else None)
        if key is not None and key not in self.pieces.pieces:
            self._capture_pieces(key)
        num_logits = len(logit_rows)
        padded = mixed or key
        padded_logits = padded[1] if padded is not None else self._logits_rows(num_logits)
        logit_rows = (logit_rows + [num_tokens - 1] * padded_logits)[:padded_logits]
        if mixed is not None:
            parts, num_rows = self.buffers.fill(chunks, logit_rows, mixed_rows=mixed[0])
        else:
            parts, num_rows = self.buffers.fill(chunks, logit_rows, pad_to=size, total_rows=key and key[0])
        self.buffers.copy_to_device(device_ids)
        start = self._tick("prepare")
        if size is not None:
            logits = _rows_of(self.graphs.replay(size), logit_rows[:num_logits])
        elif mixed is not None:
            self.runner.set_parts(parts, num_rows)
            logits = self.mixed.replay(mixed)[:num_logits]
        elif key is not None:
            self.runner.set_parts(parts, num_rows)
            with torch.inference_mode():
                logits = self.pieces.replay(key, self.runner)[:num_logits]
        else:
            logits = self._run_model(parts, num_rows, len(logit_rows))[:num_logits]
        self.stats.forward_seconds += self._tick("forward") - start
        self.stats.steps += 1
        for chunk in chunks:
            chunk.request.num_computed += chunk.num_tokens
        return logits

    def _tick(self, phase: str) -> float:
        """Adds the time since the last tick of this `step()` to `phase` (stats.phase_seconds); returns now."""
        now = time.perf_counter()
        if self._last_tick is not None:
            self.stats.phase_seconds[phase] += now - self._last_tick
            self._last_tick = now
        return now

    def step(self) -> List[Request]:
        """Runs one forward step; returns the requests that got a new token (in scheduling order)."""
        self._check_open()
        if self._launcher is not None:
            self._launcher.ensure()
        self._last_tick = start = time.perf_counter()
        gap_sample = self._gap_sample()
        self._decode_only = False
        try:
            sampled = self._step()
        finally:
            self._tick("finish")
            self._last_tick = None
        if gap_sample is not None and self._decode_only:
            device, rows, context, host_context, job_s = gap_sample
            self.auto_policy.observe_staggered(device, rows, context, time.perf_counter() - start, job_s,
                                               host_context=host_context)
        return sampled

    def _gap_sample(self) -> Optional[Tuple[int, float, float, Optional[float], Optional[float]]]:
        """offload="auto" with the staggered plan: (device rows, the block's host rows per layer, mean context
        of the device rows, that of the job's rows, the measured job fit's seconds for those rows) of the step
        about to run, whose wall time (GPU-bound once steps are queued ahead) teaches the model its host gap:
        predicted at the same two contexts as auto's verdict (`_update_stagger_ceiling`)."""
        stagger = self.stagger
        if stagger is None or self.config.offload != "auto" or self.auto_policy is None:
            return None
        running = self.scheduler.running
        if not (running or stagger.num_members):
            return None
        # prompt turns of the pipeline (its own bookkeeping, which idles with it) or prompt K/V still exporting
        if (stagger.active and not stagger.measures_decode) or self.runner.exports.queued():
            return None
        on_device = [r.num_tokens for r in running if self.kv.pool_of(r.request_id) == DEVICE_POOL]
        rows = stagger.host_rows
        host_context = stagger.rows.context or None
        context = sum(on_device) / len(on_device) if on_device else (host_context or 0.0)
        return len(on_device), rows, context, host_context, stagger.rows.job_seconds(rows) if rows else None

    def _step(self) -> List[Request]:
        if self.stagger is not None:
            if self.config.offload == "auto":
                self._update_stagger_ceiling()
            self._park_idle_pipeline()
            self._migrate_to_device()
            self.stats.recomputed += len(self.scheduler.unstall_pipeline())
            self.scheduler.parked_to_pipeline()
            if not self.stagger.num_members:
                self.stagger.idle_step()
        launched, self._ahead = self._ahead, None
        chunks = None
        captured = self._captured_seconds()
        if launched is None:
            stagger = self.stagger
            if stagger is not None and stagger.num_members and not (stagger.begun and stagger.active):
                stagger.begin_step()  # else begun by the step before, while the GPU ran it
            chunks = self._schedule()
            start = self._tick("schedule")
            launched = self._launch(chunks)
        self._ahead = self._launch_ahead(launched)  # while this step runs on the GPU
        sampled = self._resolve(launched)
        self._drop_finished_ahead()
        capture_free = self._captured_seconds() == captured
        # a step with prompt chunks, or one that captured a graph, teaches no decode step's time
        self._decode_only = capture_free and (chunks is None or all(c.decodes for c in chunks))
        policy = self.scheduler.host_policy
        if chunks is None or policy is None:
            return sampled
        if capture_free and all(c.decodes for c in chunks):
            # a decode step's wall time (the sampled ids' copy waits for the GPU) corrects auto's model
            on_host = sum(1 for c in chunks if c.pool == HOST_POOL)
            context = sum(c.start + 1 for c in chunks) / len(chunks)
            policy.observe(len(chunks) - on_host, on_host, context, time.perf_counter() - start)
        return sampled

    def _launch(self, chunks: List[ScheduledChunk], device_ids: Optional[DeviceIds] = None) -> _Launched:
        """Queues the chunks' forward and the choice of their next tokens, then the parks the step left due (their
        copies behind it); with `device_ids` (a step queued ahead) every chunk is a decode row whose input id is
        on the device."""
        logit_rows: List[int] = []
        sampled: List[Request] = []
        row = 0
        staggered = []  # the staggered block's last group: its token is through every layer
        if self.stagger is not None and self.stagger.active:
            staggered = self.stagger.sampling_rows()
            logit_rows = [r for r, _ in staggered]
            sampled = [request for _, request in staggered]
            row = self.stagger.width
        for chunk in chunks:
            row += chunk.num_tokens
            if chunk.samples or device_ids is not None:
                logit_rows.append(row - 1)
                sampled.append(chunk.request)
        logits = self._forward_chunks(chunks, logit_rows, device_ids)
        pending = self.sampler.launch(logits, sampled) if sampled else None
        for _, request in staggered:  # through every layer (before the pipeline's next turn: one lane re-enters
            request.num_computed += 1  # it at once, at its next position)
            request.steps_per_pool[HOST_POOL] += 1
        self._advance_pipeline()
        self.stats.parked += len(self.scheduler.park_launched())  # parks ahead, their copies behind this step
        return _Launched(sampled, pending, {request.request_id for _, request in staggered}, device_ids is not None)

    def _resolve(self, launched: _Launched) -> List[Request]:
        """Takes a launched step's tokens: appends them, applies the stop rules; returns the requests that got a
        token (a row queued ahead for a request that stopped or was cancelled meanwhile is dropped)."""
        if launched.pending is None:
            return []
        tokens = launched.pending.result()
        self._tick("wait")
        got = []
        for request, token in zip(launched.sampled, tokens):
            if request.status is RequestStatus.FINISHED:
                continue
            in_pipeline = request.request_id in launched.in_pipeline
            if launched.ahead and not in_pipeline:
                request.steps_per_pool[DEVICE_POOL] += 1
            got.append(request)
            request.output_token_ids.append(token)
            self.stats.generated_tokens += 1
            reason = self._stop_reason(request)
            if reason is not None:
                if in_pipeline:
                    self.scheduler.finish_staggered(request, reason)
                else:
                    self.scheduler.finish(request, reason)
                self.sampler.forget(request.request_id)
            elif (self.stagger is not None and not in_pipeline and request.status is RequestStatus.RUNNING
                  and self.kv.pool_of(request.request_id) == HOST_POOL):
                self.scheduler.to_pipeline(request)  # prefilled in the host pool: decodes staggered
        return got

    def _ahead_chunks(self, launched: _Launched) -> Optional[Tuple[List[ScheduledChunk], DeviceIds]]:
        """The next step's chunks, and where its input ids come from, if it can be queued before `launched`'s
        tokens are known: every running request decodes one token in the device pool (its input id sampled by
        `launched`, or on the host), nothing is admitted, no sampling rule needs the last
        token on the host; requests that `launched`'s token stops by length are left out. Takes their blocks
        and plans the parks the step leaves due (overlapped moves). None when any
        condition fails (counted per reason in `EngineStats.not_ahead`; the next step is scheduled as usual)."""
        scheduler = self.scheduler
        if not self._async:
            return None
        if launched.pending is None:
            return self._not_ahead("no tokens")  # `launched` samples nothing (prompt chunks only)
        # the device rows (the staggered block's requests get their next token from the pipeline, not a chunk),
        # less rows queued ahead for requests that stopped meanwhile
        # (and less those parked once `launched` was queued: their token arrives while parked)
        alive = [r for r in launched.sampled if not r.is_finished and r.request_id not in launched.in_pipeline
                 and r.status is not RequestStatus.PARKED]
        # and running requests that `launched` left out whose next input id is on the host
        sampled = {r.request_id for r in alive}
        alive += [r for r in scheduler.running
                  if r.request_id not in sampled and r.num_tokens - r.num_computed == 1]
        if len(alive) != len(scheduler.running):
            return self._not_ahead("rows")  # a request joined, finished or runs a prompt chunk
        kept = []
        for request in alive:
            sampling = request.sampling
            if self.kv.pool_of(request.request_id) != DEVICE_POOL or sampling.repetition_penalty != 1.0 or (
                    sampling.eos_token_ids and sampling.min_new_tokens > len(request.output_token_ids)):
                return self._not_ahead("host rules")  # the host-side rules need the token first
            if not self._at_length(request, pending=int(request.request_id in sampled)):
                kept.append(request)
        graphs = self.stagger_graphs if self.stagger is not None and self.stagger.active else self.graphs
        if not kept:
            return self._not_ahead("stopping")  # every device row stops by length
        if graphs is not None and not (graphs.ready and graphs.size_for(len(kept))):
            return self._not_ahead("graph")  # a step that would capture or run uncaptured
        if sum(self.kv.extra_blocks(r.request_id, r.num_computed + 1) for r in kept) > self.kv.num_free(DEVICE_POOL):
            return self._not_ahead("evict")  # someone must be evicted: the scheduler's call
        ids = self._ahead_ids(launched, kept)
        if ids is None:
            return self._not_ahead("ids")  # a group-0 token is neither on the host nor sampled by `launched`
        if not scheduler.admits_nothing():
            return self._not_ahead("admits")  # a parked or waiting request may start
        # with overlapped moves, the parks this step leaves due, issued once it is queued (`_launch_ahead`)
        scheduler.plan_parks_ahead({r.request_id: 1 for r in kept})
        for request in kept:
            self.kv.grow(request.request_id, DEVICE_POOL, request.num_computed + 1)
        return [ScheduledChunk(request, request.num_computed, 1, DEVICE_POOL) for request in kept], ids

    def _not_ahead(self, reason: str) -> None:
        """Counts a step not queued ahead for `reason` (EngineStats.not_ahead); returns None for the caller."""
        self.stats.not_ahead[reason] = self.stats.not_ahead.get(reason, 0) + 1

    def _ahead_ids(self, launched: _Launched, kept: List[Request]) -> Optional[DeviceIds]:
        """The input ids of a step queued after `launched`, on the device from its sampled ids: the device rows
        (`kept`, after the staggered block) that `launched` samples (the others' ids are on the host: resumed
        ahead) and the block's group-0 rows whose token `launched` samples (one lane: a request re-enters group
        0 the step after it sampled). None if a group-0 token is neither on the host nor among them."""
        source = {r.request_id: i for i, r in enumerate(launched.sampled)}
        rows, sources, first = [], [], 0
        if self.stagger is not None and self.stagger.active:
            first = self.stagger.width
            for row, request in self.stagger.pending_input_rows():
                if request.request_id not in source:
                    return None
                rows.append(row)
                sources.append(source[request.request_id])
        for row, request in enumerate(kept, start=first):
            if request.request_id in source:
                rows.append(row)
                sources.append(source[request.request_id])
        return DeviceIds(launched.pending.device, rows, sources)

    def _launch_ahead(self, launched: _Launched) -> Optional[_Launched]:
        """Queues the step after `launched` before its tokens reach the host (async scheduling), its input ids
        copied on the device from `launched`'s sampled ids; None where `_ahead_chunks` declines."""
        ahead = self._ahead_chunks(launched)
        if ahead is None:
            return None
        self.stats.ahead_steps += 1
        return self._launch(*ahead)

    def _drop_finished_ahead(self) -> None:
        """Forgets a step queued ahead whose requests all stopped or were cancelled: nothing of it is needed (its
        device work only touches their freed blocks, before anything queued later reuses them)."""
        if self._ahead is not None and all(r.is_finished for r in self._ahead.sampled):
            self._ahead = None

    def score(self, token_lists: Sequence[Sequence[int]]) -> List[torch.Tensor]:
        """Logits [len(tokens), vocab] of every position of each token list (a prefill only, nothing sampled)."""
        requests = self._queue(self._prepare(token_lists, SamplingParams(max_new_tokens=1)))
        pieces: dict = {r.request_id: {} for r in requests}  # start -> logits (a recomputed chunk overwrites)
        try:
            while self.has_unfinished():
                chunks = self._schedule()
                logit_rows = list(range(sum(c.num_tokens for c in chunks)))
                logits = self._forward_chunks(chunks, logit_rows)
                self.stats.parked += len(self.scheduler.park_launched())
                self._advance_pipeline()
                row = 0
                for chunk in chunks:
                    # a copy: a replayed CUDA graph rewrites its logits buffer on the next step
                    pieces[chunk.request.request_id][chunk.start] = logits[row:row + chunk.num_tokens].clone()
                    row += chunk.num_tokens
                    if chunk.samples:
                        self.scheduler.finish(chunk.request, "length")
        finally:
            self.runner.exports.wait()
            self.scheduler.abort(r.request_id for r in requests)
        return [torch.cat([piece for _, piece in sorted(pieces[r.request_id].items())]) for r in requests]

    # ----------------------------------------------------------------------------------------------------
    # request-level API

    def _encode(self, prompt: Union[str, Sequence[int]]) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass one to apex_compile.optimize(..., "
                                 "tokenizer=...) or give token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def stream(self, prompts: Sequence[Union[str, Sequence[int]]],
               sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
               progress: Optional[bool] = None) -> Iterator[TokenEvent]:
        """Generates for every prompt (strings or token-id lists), yielding each token as it is produced.

        sampling: one SamplingParams for all prompts or one per prompt (default: greedy, 64 new tokens, the
        model's EOS). Every prompt is validated here, before any work; the requests are queued when iteration
        starts, and closing the stream (`close()`, garbage collection, an error) at any point drops its
        unfinished requests and returns their blocks. progress: a tqdm bar (default: on a terminal when the run
        may generate many tokens).
        """
        return self._events(self._prepare(prompts, sampling), progress, [])

    def abort(self, request_ids: Optional[Sequence[int]] = None) -> int:
        """Cancels the unfinished requests with these ids (every one when None), returning their blocks; an
        open stream over them then ends. Returns how many were cancelled."""
        if self._closed:
            return 0
        front = self.__dict__.get("_front")
        if front is not None and self._run_owner == front._thread.ident != threading.get_ident():
            return front._call(lambda: self.abort(request_ids))  # the engine is used by one thread at a time
        dropped = self.scheduler.abort(request_ids)  # (freed host blocks wait for their exports: settle_host)
        for request in dropped:
            self.sampler.forget(request.request_id)
        self._drop_finished_ahead()
        return len(dropped)

    def _events(self, prepared: List[Request], progress: Optional[bool], queued: List[Request]
                ) -> Iterator[TokenEvent]:
        """Queues `prepared` (into `queued` too), steps until they finish and yields their tokens; when the
        generator ends in any way, its unfinished requests are dropped.

        The single caller steps the engine in its own thread (holding `_run_lock` while its run lasts); a call
        from another thread while the engine runs (the asynchronous front's thread, or another synchronous
        caller) queues onto the front instead (`apex_compile.runtime.async_engine`), so both get their answers.
        A call nested in the running caller's own thread raises as before (`_queue`)."""
        claimed = self._claim_run()
        if claimed is None:
            yield from self.front._sync_events(prepared, queued)
            return
        try:
            yield from self._events_in_thread(prepared, progress, queued)
        finally:
            if claimed:
                self._run_owner = None
                self._run_lock.release()

    def _claim_run(self) -> Optional[bool]:
        """True: this thread now holds the engine's run lock; False: it held it already (a nested call);
        None: another thread holds it."""
        if self._run_owner == threading.get_ident():
            return False
        if self._run_lock.acquire(blocking=False):
            self._run_owner = threading.get_ident()
            return True
        return None

    @property
    def _run_lock(self) -> threading.Lock:
        """Held by the thread that steps the engine: an in-thread generate/stream run, or the front."""
        with _FRONT_LOCK:
            return self.__dict__.setdefault("_run_lock_", threading.Lock())

    @property
    def _run_owner(self) -> Optional[int]:
        return self.__dict__.get("_run_owner_")

    @_run_owner.setter
    def _run_owner(self, ident: Optional[int]) -> None:
        self.__dict__["_run_owner_"] = ident

    @property
    def front(self):
        """This engine's asynchronous front (`AsyncEngine`), made on first use; `close()` stops it."""
        with _FRONT_LOCK:
            if self.__dict__.get("_front") is None:
                self._check_open()
                from apex_compile.runtime.async_engine import AsyncEngine

                self._front = AsyncEngine(self)
            return self._front

    @front.setter
    def front(self, front) -> None:
        """Installs a front built with other settings (`AsyncEngine(engine, max_waiting=...)`)."""
        with _FRONT_LOCK:
            self._front = front

    def _stop_front(self) -> None:
        front = self.__dict__.pop("_front", None)
        if front is not None:
            front.shutdown(drain=False)

    def _events_in_thread(self, prepared: List[Request], progress: Optional[bool], queued: List[Request]
                          ) -> Iterator[TokenEvent]:
        requests = self._queue(prepared)
        queued.extend(requests)
        index_of = {r.request_id: i for i, r in enumerate(requests)}
        decoded = {r.request_id: "" for r in requests}
        total = sum(r.sampling.max_new_tokens for r in requests)
        if progress is None:
            progress = sys.stderr.isatty() and total >= _PROGRESS_MIN_TOKENS
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="tok", desc="apex generate")
        try:
            while self.has_unfinished():
                for request in self.step():
                    text = ""
                    if self.tokenizer is not None:
                        full = self.tokenizer.decode(request.output_token_ids)
                        if request.finish_reason == "stop":
                            full = request.output_text
                        if not full.endswith("\ufffd") or request.is_finished:
                            text, decoded[request.request_id] = full[len(decoded[request.request_id]):], full
                    if bar is not None:
                        bar.update(1)
                    yield TokenEvent(index_of[request.request_id], request.output_token_ids[-1], text,
                                     request.finish_reason)
        finally:
            self.abort([r.request_id for r in requests])  # none left after a normal end
            if bar is not None:
                bar.close()

    def _prepare(self, prompts, sampling) -> List[Request]:
        """Validates every prompt and builds its Request (nothing is queued; raises on the first bad one)."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id lists")
        token_lists = [self._encode(p) for p in prompts]
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or self.default_sampling() for _ in token_lists]
        else:
            params = list(sampling)
            if len(params) != len(token_lists):
                raise ValueError(f"{len(params)} SamplingParams for {len(token_lists)} prompts")
        return [self._new_request(tokens, param) for tokens, param in zip(token_lists, params)]

    def _queue(self, prepared: List[Request]) -> List[Request]:
        """Queues prepared requests under fresh ids; raises if the engine is busy with other requests."""
        if self.has_unfinished():
            raise RuntimeError("the engine is already running requests (generate/stream calls do not nest; a "
                               "stream still open holds its requests: close it, or call engine.abort())")
        requests = []
        try:
            for request in prepared:
                requests.append(self._enqueue(request))
        except BaseException:
            self.abort([r.request_id for r in requests])
            raise
        return requests

    def model_eos_token_ids(self) -> Tuple[int, ...]:
        """The model's EOS token(s) as HF `generate` takes them: `generation_config.eos_token_id`, () when it has
        none (a generation config that unsets it runs to length, as in HF, whatever the model config says)."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return tuple(int(t) for t in eos)

    def default_sampling(self) -> SamplingParams:
        """Greedy, 64 new tokens, stopping at the model's EOS token(s)."""
        return SamplingParams(eos_token_ids=self.model_eos_token_ids())

    def generate(self, prompts: Sequence[Union[str, Sequence[int]]],
                 sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 progress: Optional[bool] = None) -> List[Completion]:
        """Generates for every prompt and returns one Completion per prompt, in order (see `stream`)."""
        requests: List[Request] = []
        for _ in self._events(self._prepare(prompts, sampling), progress, requests):
            pass
        return [self._completion(i, r) for i, r in enumerate(requests)]

    def chat(self, conversations, sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             progress: Optional[bool] = None) -> List[Completion]:
        """Answers chat conversations, as vLLM's `LLM.chat`: one Completion per conversation, in order.

        conversations: a list of conversations, each a list of {"role": ..., "content": ...} messages (a single
        conversation, a list of such dicts, is accepted too). Each is rendered by the tokenizer's chat template
        with the assistant's turn opened (`apply_chat_template(conv, add_generation_prompt=True,
        tokenize=False)`), then encoded without special tokens (the template writes them). sampling, progress:
        as `generate` (default: greedy, 64 new tokens, stopping at the model's EOS).
        """
        return self.generate(self.chat_prompts(conversations), sampling, progress)

    def chat_prompts(self, conversations) -> List[List[int]]:
        """Token ids of each conversation in the tokenizer's chat template, the assistant's turn opened."""
        if self.tokenizer is None:
            raise ValueError("engine.chat needs a tokenizer with a chat template: pass tokenizer= to "
                             "apex_compile.optimize")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"engine.chat needs a chat template, and the tokenizer "
                             f"({type(self.tokenizer).__name__}) has none: use engine.generate with raw prompts, "
                             f"or set tokenizer.chat_template")
        if isinstance(conversations, Sequence) and conversations and all(isinstance(m, dict) for m in conversations):
            conversations = [conversations]  # one conversation
        if (isinstance(conversations, (str, dict)) or not isinstance(conversations, Sequence) or not conversations
                or not all(isinstance(c, Sequence) and not isinstance(c, str) and c
                           and all(isinstance(m, dict) and "role" in m and "content" in m for m in c)
                           for c in conversations)):
            raise ValueError('conversations must be a non-empty list of conversations, each a non-empty list of '
                             '{"role": ..., "content": ...} messages (or one such conversation)')
        rows = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True,
                                                      tokenize=False)
            rows.append(self.tokenizer.encode(text, add_special_tokens=False))
        return rows

    def _completion(self, index: int, request: Request) -> Completion:
        text = None
        if self.tokenizer is not None:
            text = request.output_text if request.finish_reason == "stop" else self.tokenizer.decode(
                request.output_token_ids, skip_special_tokens=True)
        return Completion(index, request.prompt_token_ids, list(request.output_token_ids), text,
                          request.finish_reason, dict(zip(POOL_NAMES, request.steps_per_pool)),
                          request.num_preemptions)

    def warmup(self) -> None:
        """Compiles the step a run meets and captures the decode CUDA graphs, so that neither lands inside a
        timed run; the compiled step is shared by every engine of the model, the graphs belong to this one."""
        self._check_open()
        prompt = [int(self.model.config.bos_token_id or 1)] * 3
        # A prefill of two prompts, then two decode rows: with CUDA graphs the decode captures every size and
        # the one compiled graph (both dimensions dynamic) serves every step.
        self.generate([prompt, prompt + prompt], [SamplingParams(max_new_tokens=2, ignore_eos=True),
                                                  SamplingParams(max_new_tokens=3, ignore_eos=True)])
        if self.graphs is None:  # a lone decode row: size-1 specialisation
            self.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True))
        self.runner.compile_decode_variants(self.model.config.num_attention_heads)
        self.capture_graphs()
        if self.stagger is not None:  # the staggered step compiles too (a quiet step of padding rows)
            width = self.stagger.width
            parts, _ = self.buffers.fill([], [], pad_to=2, first_row=width)
            self.buffers.ids[:width], self.buffers.positions[:width] = 0, 0
            self.buffers.copy_to_device()
            with self._quiet_stagger(True):
                self._run_model(parts, width + 2, 2, stagger_rows=width)
            self.capture_stagger_graphs()
        self.stats = EngineStats()  # counters describe the user's runs, not the warm-up

    def blocks_in_use(self) -> dict:
        """Blocks held by requests in each pool (all zero when idle)."""
        self._check_open()
        return {POOL_NAMES[p]: self.kv.num_used(p) for p in (DEVICE_POOL, HOST_POOL)}

"""The engine: requests in, tokens out, one flattened forward step at a time.

Each step the scheduler picks chunks; the engine flattens them into input_ids / position_ids [1, T] in the
runner's token order, prepares the runner's metadata once, and runs the model's step
`step(input_ids, position_ids, logits_indices) -> logits [N, vocab]` (compiled with the "apex" backend, whose
attention ops call the runner) inside `with attention_runner(runner)`. The sampler picks the next token of
every request whose chunk reached its last token; stop conditions are checked; finished requests return
their blocks.

Where host-pool requests attend is the offload plan's business (`runtime/plans`: GPU-only, overlap, staggered):
the engine asks its plan for the scheduler's host policy and pipeline, the rows a step runs ahead of the
scheduler's chunks, the forward (which graph runs the step), the host work after the launch and the control
loop before a step; the loop itself has no plan branches.
"""
import contextlib
import dataclasses
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from apex_compile.config import GiB, ApexConfig
from apex_compile.runtime.attention_runner import PagedAttentionRunner, order_chunks
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, POOL_NAMES, CacheShape, KVManager
from apex_compile.runtime.perf_model import AutoOffload, PerfModel, StepCalibration
from apex_compile.runtime.plans import Plan, make_plan
from apex_compile.runtime.request import Request, RequestStatus, SamplingParams
from apex_compile.runtime.sampler import PendingTokens, Sampler
from apex_compile.runtime.scheduler import ScheduledChunk, Scheduler
from apex_compile.runtime.stagger import StaggerPipeline
from apex_compile.runtime.step_buffers import DeviceIds, StepBuffers

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
EAGER_ATTENTION_NAME = "apex_paged"
_PROGRESS_MIN_TOKENS = 4096  # default progress bar only for runs generating at least this many tokens
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

def _plan_attr(engine, name: str):
    """`name` of the engine's plan, None where the plan has none (or the engine is closed)."""
    return getattr(engine.__dict__.get("plan"), name, None)


@dataclasses.dataclass
class _Launched:
    """A step queued on the device whose sampled ids the host has not taken yet."""

    sampled: List[Request]  # the requests whose next token the step chooses, in logits-row order
    pending: Optional[PendingTokens]
    in_pipeline: set  # ids of the plan's lead rows' requests among them (the staggered block's)
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
        self._async = self.config.async_scheduling
        if self._async is None:
            self._async = self.device.type == "cuda"
        self._ahead: Optional[_Launched] = None  # the step queued ahead by the last `step()`, not yet resolved
        self._closed = False
        self._last_tick: Optional[float] = None  # inside `step()`: the time of its last phase tick
        self._decode_only = False  # whether the last step() only decoded (no prompt chunk, no graph captured)
        # the offload plan (runtime/plans): its pipeline and host policy shape the scheduler; its graphs, compiled
        # steps, threads and control loop are its own
        self.plan: Plan = make_plan(self)
        self.scheduler = Scheduler(self.config, self.kv, self.max_model_len, self.plan.host_policy,
                                   self.plan.pipeline)
        self.runner = PagedAttentionRunner(self.kv, self.device)
        self.runner.stagger = self.plan.pipeline
        max_rows = max(self.config.max_num_batched_tokens, self.config.max_num_seqs, 2)
        # the pipeline may take a whole prompt past the step budget (`PipelineRules.candidate`)
        pipeline_prompt = self.config.tuning.pipeline_prompt_tokens if self.plan.pipeline is not None else 0
        self.buffers = StepBuffers(self.kv, max_rows + pipeline_prompt + self.plan.block_width, self.max_model_len,
                                   self.device)
        self.plan.build_graphs(max_rows)
        self.sampler = Sampler()
        self.reports: list = []  # pass reports of the compiled step's graphs
        self.stats = EngineStats()
        self._next_id = 0
        self.plan.build_steps()

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
    def stagger(self) -> Optional[StaggerPipeline]:
        """The staggered plan's pipeline (None under the other plans, and once closed)."""
        plan = self.__dict__.get("plan")
        return plan.pipeline if plan is not None else None

    @property
    def overlap(self) -> bool:
        """Whether compiled graphs split attention into launch / device / wait (the overlap plan on CUDA)."""
        return self.plan.overlap

    # the plan's graphs (None where the plan has none of that kind, and once closed)
    graphs = property(lambda self: _plan_attr(self, "graphs"), doc="whole decode-step graphs (`DecodeGraphs`)")
    pieces = property(lambda self: _plan_attr(self, "pieces"), doc="piecewise graphs (`PiecewiseGraphs`)")
    mixed = property(lambda self: _plan_attr(self, "mixed"), doc="whole mixed-step graphs (`MixedGraphs`)")
    stagger_graphs = property(lambda self: _plan_attr(self, "stagger_graphs"),
                              doc="the staggered plan's whole decode-step graphs")
    stagger_pieces = property(lambda self: _plan_attr(self, "stagger_pieces"),
                              doc="the staggered plan's piecewise graphs")
    stagger_mixed = property(lambda self: _plan_attr(self, "stagger_mixed"),
                             doc="the staggered plan's whole mixed-step graphs")

    def _build_step(self, stagger: bool = False) -> Callable:
        """The step function: compiled with the apex backend, or eager HF modules with attention routed here."""
        model = self.model
        if not self.config.compile:
            from transformers import AttentionInterface

            from apex_compile.passes import pack_linear

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
                self.plan.close()  # its threads stop before the pools they read are freed
            finally:
                self.runner.close()
                self.kv.close()
                for name in ("kv", "scheduler", "runner", "plan", "buffers", "auto_policy"):
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
        batch = self.scheduler.schedule()  # (host blocks a move reads or frees wait for their exports: settle_host)
        if not batch.chunks and not self.plan.lead_rows():  # a step of lead rows only may have no chunk
            raise RuntimeError("scheduler found nothing to run although requests are pending")
        self.stats.moved += len(batch.moved)
        self.stats.parked += len(batch.parked)
        self.stats.recomputed += len(batch.recomputed)
        for chunk in batch.chunks:
            if chunk.request.steps_per_pool[chunk.pool] == 1:
                self.stats.requests_per_pool[chunk.pool] += 1
        self.kv.wait_for_moves()
        return order_chunks(batch.chunks)

    def capture_graphs(self, progress: bool = True) -> None:
        """Captures the decode CUDA graphs of every capture size (done by `warmup`, else at the first decode)."""
        self.plan.capture_graphs(progress)

    def capture_stagger_graphs(self, progress: bool = True) -> None:
        """Captures the whole-step graphs of staggered decode steps, every capture size (the staggered plan only;
        done by `warmup`, else at the first such step)."""
        capture = getattr(self.plan, "capture_stagger_graphs", None)
        if capture is not None:
            capture(progress)

    def _forward_chunks(self, chunks: List[ScheduledChunk], logit_rows: List[int],
                        device_ids: Optional[DeviceIds] = None) -> torch.Tensor:
        """Runs the model on the chunks (flattened in order, after the plan's lead rows) and returns the logits
        of `logit_rows`, the graph chosen by the plan. device_ids: input ids already on the device (a step
        queued before the host has them)."""
        return self.plan.forward(chunks, logit_rows, device_ids)

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
        plan = self.plan
        plan.enter_step()
        self._last_tick = start = time.perf_counter()
        gap_sample = plan.gap_sample()
        self._decode_only = False
        try:
            sampled = self._step()
        finally:
            self._tick("finish")
            self._last_tick = None
        if gap_sample is not None and self._decode_only:
            plan.observe_gap(gap_sample, time.perf_counter() - start)
        return sampled

    def _step(self) -> List[Request]:
        plan = self.plan
        plan.before_schedule()
        launched, self._ahead = self._ahead, None
        chunks = None
        captured = plan.captured_seconds()
        if launched is None:
            plan.begin_step()
            chunks = self._schedule()
            start = self._tick("schedule")
            launched = self._launch(chunks)
        self._ahead = self._launch_ahead(launched)  # while this step runs on the GPU
        sampled = self._resolve(launched)
        self._drop_finished_ahead()
        capture_free = plan.captured_seconds() == captured
        # a step with prompt chunks, or one that captured a graph, teaches no decode step's time
        self._decode_only = capture_free and (chunks is None or all(c.decodes for c in chunks))
        if chunks is not None and capture_free and all(c.decodes for c in chunks):
            plan.observe_step(chunks, start)
        return sampled

    def _launch(self, chunks: List[ScheduledChunk], device_ids: Optional[DeviceIds] = None) -> _Launched:
        """Queues the chunks' forward and the choice of their next tokens, then the parks the step left due (their
        copies behind it); with `device_ids` (a step queued ahead) every chunk is a decode row whose input id is
        on the device."""
        lead = self.plan.lead_sampling_rows()  # the plan's rows ahead of the chunks that sample this step
        logit_rows: List[int] = [r for r, _ in lead]
        sampled: List[Request] = [request for _, request in lead]
        row = self.plan.lead_rows()  # the chunks' rows follow the lead rows
        for chunk in chunks:
            row += chunk.num_tokens
            if chunk.samples or device_ids is not None:
                logit_rows.append(row - 1)
                sampled.append(chunk.request)
        logits = self._forward_chunks(chunks, logit_rows, device_ids)
        pending = self.sampler.launch(logits, sampled) if sampled else None
        self.plan.after_launch(lead)
        self.stats.parked += len(self.scheduler.park_launched())  # parks ahead, their copies behind this step
        return _Launched(sampled, pending, {request.request_id for _, request in lead}, device_ids is not None)

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
                    self.scheduler.pipeline_rules.finish(request, reason)
                else:
                    self.scheduler.finish(request, reason)
                self.sampler.forget(request.request_id)
            elif not in_pipeline:
                self.plan.took_token(request)  # where it decodes next (the staggered plan: its pipeline)
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
        graphs = self.plan.ahead_graphs()
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
        rows, sources, first = [], [], self.plan.lead_rows()
        for row, request in self.plan.lead_input_rows():
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
                self.plan.after_launch([])
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
        self.plan.warmup()  # its graphs captured, its other compiled steps (the staggered one) compiled
        self.stats = EngineStats()  # counters describe the user's runs, not the warm-up

    def blocks_in_use(self) -> dict:
        """Blocks held by requests in each pool (all zero when idle)."""
        self._check_open()
        return {POOL_NAMES[p]: self.kv.num_used(p) for p in (DEVICE_POOL, HOST_POOL)}

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
loop before a step; the loop itself has no plan branches. The step function is built in `model_step.py`; the
user's calls over the loop (generate, stream, chat, abort, the asynchronous front) are `engine_api.EngineAPI`.
"""
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from apex_compile.config import GiB, ApexConfig
from apex_compile.runtime.attention_runner import PagedAttentionRunner, order_chunks
from apex_compile.runtime.batch_model import BatchPrediction
from apex_compile.runtime.engine_api import EngineAPI
from apex_compile.runtime.model_step import build_step, check_supported
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, POOL_NAMES, CacheShape, KVManager
from apex_compile.runtime.perf_model import AutoOffload, PerfModel, StepCalibration
from apex_compile.runtime.plans import Plan, make_plan
from apex_compile.runtime.request import Request, RequestStatus, SamplingParams
from apex_compile.runtime.sampler import PendingTokens, Sampler
from apex_compile.runtime.scheduler import ScheduledChunk, Scheduler
from apex_compile.runtime.stagger import StaggerPipeline
from apex_compile.runtime.step_buffers import DeviceIds, StepBuffers



PHASES = ("schedule", "prepare", "forward", "pipeline", "wait", "finish")
# what a step computes (`step_kind`), the kinds the batch model prices apart (`runtime/batch_model.py`)
STEP_KINDS = ("decode", "staggered decode", "prompt", "staggered prompt", "pipeline prompt")
SLOWEST_STEPS = 5  # how many of a run's longest step() calls `EngineStats.slowest_steps` keeps


def step_kind(chunks, staggered: bool) -> str:
    """A step's kind: a host-pool prompt (the staggered pipeline's entry, its whole prompt in the step), device
    prompt chunks, or decode rows only; "staggered" where the pipeline's block leads it."""
    if any(c.pool == HOST_POOL and not c.decodes for c in chunks):
        return "pipeline prompt"
    kind = "decode" if all(c.decodes for c in chunks) else "prompt"
    return "staggered " + kind if staggered else kind


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
    emptied: int = 0  # pipeline members parked because auto's ceiling fell to 0 (they resume in the device pool)
    # the step (`steps` then) at which the last request first ran in the host pool: a pipeline member gains a token
    # per cycle steps, so a batch's late entrants set its end unless they move to the device pool
    last_host_entry_step: int = 0
    ahead_steps: int = 0  # steps queued before the previous step's tokens reached the host (async scheduling)
    # why a step was not queued ahead, per reason (`Engine._ahead_chunks`): each such step leaves the GPU idle while
    # the host schedules and prepares it
    not_ahead: Dict[str, int] = dataclasses.field(default_factory=dict)
    # the main thread's time per part of `step()`, seconds: schedule (the pipeline's begin when not begun
    # earlier, the scheduler), prepare (step buffers, their copy, the CPU job's outputs), forward (queuing the
    # graphs or running the step), pipeline (the staggered block's host work behind it), wait (for the sampled
    # ids: where the GPU sets the pace), finish (stop checks, the scheduler's updates)
    phase_seconds: Dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # per kind of step (`STEP_KINDS`): [steps, seconds of the step() calls that took their tokens, the longest
    # call]; each call takes one step's tokens, so in a run where the GPU sets the pace a call's time is its step's
    # on the GPU; the longest tells a one-off (a graph captured, a shape compiled mid-run) from a per-step cost
    step_kinds: Dict[str, List[float]] = dataclasses.field(
        default_factory=lambda: {kind: [0, 0.0, 0.0] for kind in STEP_KINDS})
    # the SLOWEST_STEPS longest step() calls, longest first, each {"step", "kind", "seconds", "phases": the main
    # thread's seconds per phase of that call, "captured": seconds of CUDA graphs captured inside it}: where a
    # one-off of a run (a capture, a compile, a first allocation) spent its time
    slowest_steps: List[dict] = dataclasses.field(default_factory=list)

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
    kind: str = "decode"  # `step_kind`


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


class Engine(EngineAPI):
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
        self._resolved_kind: Optional[str] = None  # the kind of the step whose tokens this step() took
        # the offload plan (runtime/plans): its pipeline and host policy shape the scheduler; its graphs, compiled
        # steps, threads and control loop are its own
        self.plan: Plan = make_plan(self)
        self.scheduler = Scheduler(self.config, self.kv, self.max_model_len, self.plan.host_policy,
                                   self.plan.pipeline)
        self.plan.attach(self.scheduler)
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
        """The step function of this engine's model and plan (`model_step.build_step`); the GPU-only step's pass
        reports go to `reports`."""
        step, reports = build_step(self.model, self.device, self.config, self.overlap, stagger)
        if not stagger and reports is not None:
            self.reports = reports
        return step

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

    @property
    def requests_added(self) -> int:
        """Requests queued since the engine was built."""
        return self._next_id

    def predict_batch(self, lengths: Sequence[Tuple[int, int]]) -> Dict[str, BatchPrediction]:
        """The predicted makespan of a batch of (prompt, output) token counts submitted at once to this idle
        engine (`runtime/batch_model.py`): "never" (GPU-only), and "auto" where offload="auto" runs the
        staggered plan (its pipeline taking the batch's tail where that pays). CUDA only: the prices are the
        engine's measured profile and captured graphs (`warmup` first)."""
        from apex_compile.runtime.batch_model import engine_limits, engine_state, predict_batch
        from apex_compile.runtime.perf_profile import engine_profile

        if self.device.type != "cuda":
            raise RuntimeError("Engine.predict_batch prices steps by a profile measured on CUDA; this engine runs "
                               f"on {self.device}")
        if self.has_unfinished():
            raise RuntimeError("Engine.predict_batch predicts a batch on an idle engine; this one has requests")
        lengths = [(int(p), int(o)) for p, o in lengths]
        if any(p < 1 or o < 1 for p, o in lengths):
            raise ValueError("Engine.predict_batch: every request needs >= 1 prompt and >= 1 output token")
        policy = self.auto_policy or PerfModel(engine_profile(self), self.calibration)
        limits = engine_limits(self)
        _, state = engine_state(self)  # idle: only the graphs the engine holds already
        out = {"never": predict_batch(policy, lengths, limits, state=state)}
        if self.plan.pipeline is not None and self.config.offload == "auto":
            out["auto"] = predict_batch(policy, lengths, limits, pipeline=True, state=state)
        return out

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
                if chunk.pool == HOST_POOL:
                    self.stats.last_host_entry_step = self.stats.steps
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
        phases_before = list(self.stats.phase_seconds.values())
        captured_before = plan.captured_seconds()
        self._last_tick = start = time.perf_counter()
        gap_sample = plan.gap_sample()
        self._decode_only = False
        self._resolved_kind = None
        try:
            sampled = self._step()
        finally:
            self._tick("finish")
            self._last_tick = None
        if self._resolved_kind is not None:
            record = self.stats.step_kinds[self._resolved_kind]
            seconds = time.perf_counter() - start
            record[0] += 1
            record[1] += seconds
            record[2] = max(record[2], seconds)
            slowest = self.stats.slowest_steps
            if len(slowest) < SLOWEST_STEPS or seconds > slowest[-1]["seconds"]:
                self._note_slow_step(seconds, phases_before, plan.captured_seconds() - captured_before)
        if gap_sample is not None and self._decode_only:
            plan.observe_gap(gap_sample, time.perf_counter() - start)
        return sampled

    def _note_slow_step(self, seconds: float, phases_before: List[float], captured: float) -> None:
        """Keeps this step() call among `stats.slowest_steps` (longest first, SLOWEST_STEPS of them)."""
        phases = {phase: now - before
                  for (phase, now), before in zip(self.stats.phase_seconds.items(), phases_before) if now > before}
        slowest = self.stats.slowest_steps
        slowest.append({"step": self.stats.steps, "kind": self._resolved_kind, "seconds": seconds, "phases": phases,
                        "captured": captured})
        slowest.sort(key=lambda entry: -entry["seconds"])
        del slowest[SLOWEST_STEPS:]

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
        kind = step_kind(chunks, row > 0)
        for chunk in chunks:
            row += chunk.num_tokens
            if chunk.samples or device_ids is not None:
                logit_rows.append(row - 1)
                sampled.append(chunk.request)
        logits = self._forward_chunks(chunks, logit_rows, device_ids)
        pending = self.sampler.launch(logits, sampled) if sampled else None
        self.plan.after_launch(lead)
        self.stats.parked += len(self.scheduler.park_launched())  # parks ahead, their copies behind this step
        return _Launched(sampled, pending, {request.request_id for _, request in lead}, device_ids is not None,
                         kind)

    def _resolve(self, launched: _Launched) -> List[Request]:
        """Takes a launched step's tokens: appends them, applies the stop rules; returns the requests that got a
        token (a row queued ahead for a request that stopped or was cancelled meanwhile is dropped)."""
        self._resolved_kind = launched.kind
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
        self._calibrate_prompt_step()
        self.stats = EngineStats()  # counters describe the user's runs, not the warm-up

    def _calibrate_prompt_step(self) -> None:
        """Times a prompt-only step of a full step budget as a batch runs it (its graph, the host's work, the
        first token's sample) into the calibration (`PerfModel.prompt_s` prices prompt tokens with it). Only
        where the decode graphs were timed (CUDA graphs) and the device pool holds such a prompt."""
        if not self.calibration.rows:
            return
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len - 1)
        block_size = self.shape.block_size
        if self.kv.pools[DEVICE_POOL].num_blocks * block_size < tokens + 2 * block_size:
            return
        prompt = [int(self.model.config.bos_token_id or 1)] * tokens
        sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
        seconds = []
        for _ in range(3):  # the first captures the step's graph
            self.stats = EngineStats()
            self.generate([prompt], sampling, progress=False)
            count, total, _ = self.stats.step_kinds["prompt"]
            if count == 1:
                seconds.append(total)
        if len(seconds) > 1:
            self.calibration.prompt_tokens, self.calibration.prompt_s = tokens, min(seconds[1:])

    def blocks_in_use(self) -> dict:
        """Blocks held by requests in each pool (all zero when idle)."""
        self._check_open()
        return {POOL_NAMES[p]: self.kv.num_used(p) for p in (DEVICE_POOL, HOST_POOL)}

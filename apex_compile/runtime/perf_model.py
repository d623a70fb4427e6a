"""The performance model that decides how many requests attend on the CPU (APEX's scheduling question).

A `Profile` holds what was measured once per (GPU, CPU, model shape, dtype): the time of all linear layers of a
step against its token count, the GPU's and the CPU's attention time of a step against the context tokens they
read, the CPU attention's fixed cost per step, and the PCIe rate of the staging copies. `PerfModel` predicts a
decode step per plan from it and picks the plan and host share with the most tokens per second, never one
predicted slower than GPU-only:

- "never": every request in the device pool: T_lin(n) + T_gatt(ctx_g).
- "overlap": one batch; per layer the host rows' CPU attention (and its copies) overlaps only the device rows'
  attention: T_lin(n_g + n_c) + max(T_gatt(ctx_g), T_catt(ctx_c) + T_copy).
- "pipeline": two sub-batches (NEO-style asymmetric pipelining): the CPU attends the host sub-batch's layer
  while the GPU runs the device sub-batch's, and the reverse; each sub-batch's linear layers read every weight,
  so the GPU sweeps the weights twice: max(T_lin(n_g) + T_lin(n_c) + T_gatt(ctx_g), T_catt(ctx_c) + T_copy).
- "staggered" (apex_compile.runtime.stagger): n_c host rows per step, each a request one layer further on
  than the step before, join the device rows' GEMMs; each CPU attention has a whole step to finish, and the
  block's copies (its q/k/v out, the outputs in) run on the compute stream between the graphs:
  max(T_lin(n_g + n_c) + T_gatt(ctx_g) + T_copy, T_job(ctx_c)), n_c tokens per step from
  2 * (num_layers + 1) * n_c host requests in flight (two lanes take turns). T_job is one call over every
  layer, at the CPU's bandwidth (T_catt, the per-layer probe, adds 32 calls' fixed costs at small contexts).

In one batch the CPU's attention hides only behind the device rows' attention (overlap) or costs another
sweep of the weights (pipeline): rows that share a layer's GEMMs all need that layer's attention before its
output projection. Where a step is its weight reads (memory-bound decode on a fast GPU) both cost more than
the host rows add; the staggered plan is the one that overlaps the CPU with the whole single-sweep step.

`ideal_gain` is the physics bound every result is judged against: the tokens/s the CPU's attention bandwidth
can add, B_cpu / (KV bytes a host request reads per step).

A `StepCalibration` (an engine's own captured decode graphs replayed over padding rows, measured when they
are captured) replaces T_lin by the step as it really runs: the merged GEMMs, the norms, RoPE, the cache
appends, the kernel boundaries and, for the staggered graph, the block's row exchange. A calibrated step is
T_graph(rows) + T_gatt(ctx) - T_gatt(rows) (the replays' padding rows each read one token); the staggered
plan adds the block's copies of all its rows (they run outside the graph, on the compute stream). The engine's
warm-up also times one prompt-only step of its step budget as a batch runs it (`Engine._calibrate_prompt_step`):
prompt tokens are priced at their linear layers plus, per token, what that step took beyond the model's price
(`prompt_s`).

A `HostGap` adds what neither the profile nor the replays see: the host's time between two steps that the GPU
waits for (scheduling, filling the step's buffers, the staggered block's collect), learned online from the
engine's own decode steps: the median of the last steps' measured minus predicted time, per kind (with and
without host rows), each step predicted from the steps before it only.
"""
import bisect
import collections
import dataclasses
import json
import os
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

PLANS = ("never", "overlap", "pipeline", "staggered")


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the measured points (xs ascending), extended linearly past both ends and
    never below zero."""
    if len(xs) == 1:
        return max(ys[0] * x / xs[0] if xs[0] else ys[0], 0.0)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclasses.dataclass
class Profile:
    """Measured costs of one machine and model shape (seconds per decode step, all layers)."""

    key: str  # GPU, CPU, model shape and dtype, for the on-disk cache
    linear_tokens: List[int]
    linear_s: List[float]
    gpu_attention_ctx: List[int]  # context tokens read by a step's GPU attention (sum over its requests)
    gpu_attention_s: List[float]
    cpu_attention_ctx: List[int]
    cpu_attention_s: List[float]
    kv_bytes_per_token: int  # K + V over all layers
    copy_bytes_per_token: int  # q, k, v to the host and the output back, all layers, per host row
    copy_bytes_per_s: float

    def save(self, path: str) -> None:
        """Writes the profile as JSON (the directory is created)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        """Reads a profile written by `save`."""
        with open(path) as f:
            return cls(**json.load(f))


@dataclasses.dataclass
class StepCalibration:
    """Seconds of an engine's captured decode graphs replayed over padding rows (one context token each):
    `rows` / `step_s` the GPU-only graphs, `stagger_rows` / `stagger_s` the staggered ones (device rows; the
    block's `stagger_width` rows come on top)."""

    rows: List[int] = dataclasses.field(default_factory=list)
    step_s: List[float] = dataclasses.field(default_factory=list)
    stagger_rows: List[int] = dataclasses.field(default_factory=list)
    stagger_s: List[float] = dataclasses.field(default_factory=list)
    stagger_width: int = 0
    # a prompt-only step of `prompt_tokens` tokens (one request's chunk of the step budget) as the engine's
    # warm-up ran it: its graph, the host's work around it and its token's sample (0: not measured)
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    # one capture of the staggered plan's pieces for a pipeline prompt step past PIECEWISE_MAX_TOKENS rows, as its
    # warm-up timed a second key after the largest (each new row count of such steps is captured once, inside the
    # run that meets it; 0: not measured)
    piece_capture_s: float = 0.0


@dataclasses.dataclass
class Prediction:
    """One plan's predicted decode step for a batch."""

    plan: str
    gpu_requests: int
    cpu_requests: int
    step_s: float

    @property
    def tokens_per_s(self) -> float:
        return (self.gpu_requests + self.cpu_requests) / self.step_s


class PerfModel:
    """Predicts decode steps per plan from a Profile and chooses where requests attend."""

    def __init__(self, profile: Profile, calibration: Optional[StepCalibration] = None):
        self.profile = profile
        self.calibration = calibration

    def _context_s(self, rows: int, context: float) -> float:
        """GPU attention of `rows` requests of `context` tokens beyond the one token a calibration row reads."""
        return max(self.gpu_attention_s(int(rows * context)) - self.gpu_attention_s(rows), 0.0)

    def is_calibrated(self, stagger: bool) -> bool:
        """Whether the replays of the GPU-only (or, with `stagger`, the staggered) graphs are in."""
        c = self.calibration
        return c is not None and bool(c.stagger_rows if stagger else c.rows)

    def prompt_s(self, rows: int, tokens: int) -> float:
        """Seconds that `tokens` prompt tokens add to a step of `rows` decode rows: their linear layers (the
        profile's GEMM points) and, where the calibration timed a prompt-only step, what those points miss, per
        token (prefill attention, the norms and RoPE at that many rows, the step's host work; less the LM head the
        points include and a prompt token does not compute). That residual is one measurement at one context;
        prefill attention's growth with a longer context is left out."""
        if not tokens:
            return 0.0
        dense = max(rows, 1)
        linear = self.linear_s(dense + tokens) - self.linear_s(dense)
        return max(linear + tokens * self.prompt_residual_s(), 0.0)

    def prompt_residual_s(self) -> float:
        """Seconds per prompt token that the calibration's prompt-only step took beyond the model's price of it
        (a decode step of one row plus the prompt's linear layers); 0 without that measurement."""
        c = self.calibration
        if c is None or not c.prompt_tokens or not self.is_calibrated(False):
            return 0.0
        tokens = c.prompt_tokens
        base = self.predict("never", 1, 0, 1.0).step_s + self.linear_s(1 + tokens) - self.linear_s(1)
        return (c.prompt_s - base) / tokens

    def linear_s(self, tokens: int) -> float:
        p = self.profile
        return interpolate(p.linear_tokens, p.linear_s, tokens)

    def gpu_attention_s(self, context_tokens: int) -> float:
        p = self.profile
        return interpolate(p.gpu_attention_ctx, p.gpu_attention_s, context_tokens) if context_tokens else 0.0

    def cpu_attention_s(self, context_tokens: int) -> float:
        p = self.profile
        return interpolate(p.cpu_attention_ctx, p.cpu_attention_s, context_tokens) if context_tokens else 0.0

    def cpu_job_s(self, context_tokens: int) -> float:
        """The staggered plan's CPU job over that many context tokens: one call over every layer's rows, read at
        the CPU's bandwidth (its largest probe, where the probe's per-layer calls are amortized). The probe's
        smaller points, extrapolated below them, keep 32 calls' fixed costs that the one-call job does not pay."""
        return context_tokens * self.cpu_seconds_per_token() if context_tokens else 0.0

    def copy_s(self, cpu_requests: int) -> float:
        p = self.profile
        return cpu_requests * p.copy_bytes_per_token / p.copy_bytes_per_s

    def predict(self, plan: str, gpu_requests: int, cpu_requests: int, context: float,
                cpu_job: Optional[Tuple[float, float]] = None, cpu_context: Optional[float] = None) -> Prediction:
        """The step of `plan` with that many requests per pool, each reading `context` tokens of KV. cpu_job:
        (fixed seconds, seconds per context token) of a measured staggered CPU job, in place of the profile's.
        cpu_context: the host requests' own mean context where it differs (a staggered host request gains a token
        per num_layers + 1 steps, so the pipeline's contexts lag the device rows'); None: `context`."""
        if plan not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
        if plan == "never" and cpu_requests:
            raise ValueError("plan 'never' runs no request on the CPU")
        c = self.calibration
        if not cpu_requests:
            if self.is_calibrated(False):
                step = interpolate(c.rows, c.step_s, gpu_requests) + self._context_s(gpu_requests, context)
            else:
                step = self.linear_s(gpu_requests) + self.gpu_attention_s(int(gpu_requests * context))
            return Prediction("never", gpu_requests, 0, step)
        job_s = self.cpu_job_s if cpu_job is None else (lambda tokens: cpu_job[0] + tokens * cpu_job[1])
        host_tokens = int(cpu_requests * (context if cpu_context is None else cpu_context))
        if plan == "staggered" and self.is_calibrated(True):
            gpu = (interpolate(c.stagger_rows, c.stagger_s, gpu_requests) + self._context_s(gpu_requests, context)
                   + self.copy_s(max(c.stagger_width, cpu_requests)))
            step = max(gpu, job_s(host_tokens))
            return Prediction(plan, gpu_requests, cpu_requests, step)
        n = gpu_requests + cpu_requests
        gpu_attention = self.gpu_attention_s(int(gpu_requests * context))
        cpu = self.cpu_attention_s(host_tokens) + self.copy_s(cpu_requests)
        if plan == "overlap":
            step = self.linear_s(n) + max(gpu_attention, cpu)
        elif plan == "staggered":  # its copies serialize with the GPU's work, not the CPU's
            step = max(self.linear_s(n) + gpu_attention + self.copy_s(cpu_requests), job_s(host_tokens))
        else:
            step = max(self.linear_s(gpu_requests) + self.linear_s(cpu_requests) + gpu_attention, cpu)
        return Prediction(plan, gpu_requests, cpu_requests, step)

    def choose(self, gpu_capacity: int, cpu_capacity: int, context: float,
               plans: Sequence[str] = PLANS, stagger_groups: int = 1) -> Prediction:
        """The plan (among `plans`) and host share with the most tokens/s when the device pool holds
        `gpu_capacity` requests and the host pool `cpu_capacity` more; GPU-only ("never") unless a plan is
        predicted faster. The staggered plan's host rows (cpu_requests) each need `stagger_groups` (2 x the
        model's layers + 1) requests in the host pool."""
        best = self.predict("never", gpu_capacity, 0, context)
        for plan in [p for p in plans if p != "never"]:
            limit = cpu_capacity // stagger_groups if plan == "staggered" else cpu_capacity
            for cpu_requests in range(1, limit + 1):
                candidate = self.predict(plan, gpu_capacity, cpu_requests, context)
                if candidate.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
                    best = candidate
        return best

    def cpu_bandwidth(self) -> float:
        """Bytes/s the CPU attention reads at the largest profiled context."""
        p = self.profile
        return p.cpu_attention_ctx[-1] * p.kv_bytes_per_token / p.cpu_attention_s[-1]

    def cpu_seconds_per_token(self) -> float:
        """Seconds the CPU attention takes per context token of a request, all layers, at its bandwidth."""
        return self.profile.kv_bytes_per_token / self.cpu_bandwidth()

    def gpu_bandwidth(self) -> float:
        """Bytes/s the GPU attention reads at the largest profiled context."""
        p = self.profile
        return p.gpu_attention_ctx[-1] * p.kv_bytes_per_token / p.gpu_attention_s[-1]

    def ideal_gain(self, context: float, cpu_bandwidth: Optional[float] = None) -> float:
        """Tokens/s the CPU's attention bandwidth (the profile's, or `cpu_bandwidth` bytes/s measured elsewhere)
        can add: B_cpu / KV bytes a host request reads per step."""
        bandwidth = self.cpu_bandwidth() if cpu_bandwidth is None else cpu_bandwidth
        return bandwidth / (self.profile.kv_bytes_per_token * context)

    def explain(self, gpu_capacity: int, cpu_capacity: int, context: float,
                plans: Sequence[str] = PLANS, stagger_groups: int = 1) -> List[str]:
        """The model's inputs and verdict in APEX's terms, one line each."""
        never = self.predict("never", gpu_capacity, 0, context)
        t_lin = self.linear_s(gpu_capacity)
        t_att = self.gpu_attention_s(int(gpu_capacity * context))
        choice = self.choose(gpu_capacity, cpu_capacity, context, plans, stagger_groups)
        lhs, rhs, holds = apex_pipeline_inequality(choice.gpu_requests, max(choice.cpu_requests, 1), t_lin, t_att)
        gain = choice.tokens_per_s - never.tokens_per_s
        cpu_gbps, gpu_gbps = self.cpu_bandwidth() / 1e9, self.gpu_bandwidth() / 1e9
        return [
            f"CPU/GPU attention bandwidth ratio: {cpu_gbps / gpu_gbps:.3f} ({cpu_gbps:.1f} vs {gpu_gbps:.1f} GB/s)",
            f"attention share of a GPU-only step: {t_att / max(never.step_s, 1e-12):.1%} (T_lin {t_lin * 1e3:.2f} ms, "
            f"T_att {t_att * 1e3:.2f} ms at {gpu_capacity} requests x {context:.0f} tokens)",
            f"APEX pipelining condition N_G/N_C < 2*T_lin/T_att + 3 + T_att/T_lin: {lhs:.2f} < {rhs:.2f} -> "
            f"{'holds' if holds else 'fails'}",
            f"verdict: {choice.plan} with {choice.cpu_requests} request(s) on the CPU, predicted "
            f"{choice.tokens_per_s:.0f} vs {never.tokens_per_s:.0f} tokens/s GPU-only (gain {gain:+.0f} tokens/s; "
            f"ideal_gain {self.ideal_gain(context):.0f} tokens/s)",
        ]


class HostGap:
    """A decode step's time beyond the model's GPU-side prediction (the host gap before its replay), learned
    online: per kind (steps with host rows or without) the median residual (measured - predicted) of the last
    `history` decode steps; 0 until `min_steps` were seen."""

    def __init__(self, history: int = 32, min_steps: int = 8):
        self.min_steps = min_steps
        self.residuals = {False: collections.deque(maxlen=history), True: collections.deque(maxlen=history)}

    def seconds(self, host: bool) -> float:
        seen = self.residuals[bool(host)]
        return statistics.median(seen) if len(seen) >= self.min_steps else 0.0

    def observe(self, host: bool, predicted_s: float, measured_s: float) -> None:
        self.residuals[bool(host)].append(measured_s - predicted_s)


def step_host_context(step) -> Optional[float]:
    """The host rows' own context of a recorded step (device rows, host rows, context, seconds, prefill tokens[,
    host context]); None (the step's context) for a record without it."""
    return step[5] if len(step) > 5 and step[5] else None


def online_predictions(model: "PerfModel", steps, plan: str = "staggered", history: int = 32) -> List[Tuple[float,
                                                                                                       float]]:
    """(predicted, measured) seconds of each decode-only step of `steps` ((device rows, host rows, context,
    seconds, prefill tokens[, the host rows' context]) in the order they ran): the model's step plus the `HostGap`
    learned from the decode steps before it (none from the step itself or later); the first steps of each kind,
    before the gap has its minimum of samples, are predicted without it."""
    gap = HostGap(history)
    pairs = []
    for step in steps:
        gpu, cpu, context, seconds, prefill_tokens = step[:5]
        if prefill_tokens:
            continue
        base = model.predict(plan if cpu else "never", gpu, cpu, context, cpu_context=step_host_context(step)).step_s
        pairs.append((base + gap.seconds(bool(cpu)), seconds))
        gap.observe(bool(cpu), base, seconds)
    return pairs


def apex_pipeline_inequality(gpu_requests: int, cpu_requests: int, t_linear: float, t_attention: float
                             ) -> Tuple[float, float, bool]:
    """APEX's condition for asymmetric pipelining to pay: (N_G / N_C, 2 T_lin/T_att + 3 + T_att/T_lin, holds)."""
    lhs = gpu_requests / cpu_requests
    if t_attention <= 0 or t_linear <= 0:
        return lhs, float("inf"), True
    rhs = 2 * t_linear / t_attention + 3 + t_attention / t_linear
    return lhs, rhs, lhs < rhs


def profile_path(key: str, root: Optional[str] = None) -> str:
    """Where the profile of `key` is cached: <compile cache dir>/perf_model/<key>.json."""
    from apex_compile.config import compile_cache_dir

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    return os.path.join(root or compile_cache_dir(), "perf_model", safe + ".json")


def cached_profile(key: str, measure, root: Optional[str] = None) -> Profile:
    """The cached profile of `key`, or `measure()`'s result saved for the next process."""
    path = profile_path(key, root)
    if os.path.exists(path):
        return Profile.load(path)
    profile = measure()
    profile.save(path)
    return profile


def summarize(profile: Profile) -> Dict[str, float]:
    """A few headline numbers of a profile (bandwidths in GB/s)."""
    model = PerfModel(profile)
    return {"cpu_attention_GBps": model.cpu_bandwidth() / 1e9, "gpu_attention_GBps": model.gpu_bandwidth() / 1e9}


# The predicted gain the staggered plan must show over GPU-only: its model counts decode steps only and leaves
# out part of the block's host work (its prompts' export, its mixed steps), so a predicted gain below this
# margin measured as a loss or a wash; a smaller margin admitted pipelines that lost throughput.
STAGGER_MARGIN = 0.15
# The gain a running pipeline (one with members) needs to keep its rows: the margin above is paid for at the
# rise (the first members' host prompts); a verdict that dips under it with the pipeline full would park every
# member and refill it later through that cost again. The prediction moves by several percent with the device
# rows while the calibrated error of a running pipeline is a few percent, so one predicted at +8% still gains.
STAGGER_KEEP_MARGIN = 0.08
# The gain a closed pipeline's members need to go on decoding on the host (no request joins it; it empties as they
# finish) rather than all be parked at once to resume in the device pool: that mass park and the device pool's
# churn after it are costs the model leaves out.
STAGGER_HOLD_MARGIN = 0.0
RUNNABLE_PLANS = ("never", "overlap", "staggered")  # the plans the engine executes ("staggered" when asked for)


class AutoOffload:
    """offload="auto": the scheduler's host-pool policy. A request goes to the host pool only when the device
    pool cannot take it and the model predicts more tokens/s with it there (by `margin`); predictions of host
    plans are scaled by what the engine measured for them (`observe`), so a model that flatters the host stops
    admitting host requests after a few steps."""

    def __init__(self, model: PerfModel, margin: float = 0.02, stagger_groups: int = 1,
                 stagger_margin: float = STAGGER_MARGIN, stagger_keep_margin: float = STAGGER_KEEP_MARGIN,
                 stagger_hold_margin: float = STAGGER_HOLD_MARGIN, max_stagger_rows: int = 12):
        """stagger_groups: host requests per staggered row (2 x the model's layers + 1); stagger_margin: the
        predicted gain over GPU-only the staggered plan needs (`STAGGER_MARGIN`); stagger_keep_margin: the gain a
        running pipeline needs to keep its rows (`STAGGER_KEEP_MARGIN`); stagger_hold_margin: the gain a closed
        pipeline's members need to finish on the host (`STAGGER_HOLD_MARGIN`); max_stagger_rows: the most host
        rows per step `explain` considers (the adaptive block's width, `TuningConfig.auto_stagger_width`)."""
        self.max_stagger_rows = max_stagger_rows
        self.model = model
        self.margin = margin
        self.stagger_margin = stagger_margin
        self.stagger_keep_margin = stagger_keep_margin
        self.stagger_hold_margin = stagger_hold_margin
        self.stagger_groups = stagger_groups
        # measured / predicted decode-step time (running means) of steps with host rows and of GPU-only steps
        self.correction = 1.0
        self.never_correction = 1.0
        self.observed = [0, 0]
        # the staggered plan's host gap per kind of decode step (with host rows or without), learned online
        self.gap = HostGap()
        self.cpu_job: Optional[Tuple[float, float]] = None  # the measured job's (fixed s, s per context token)

    def learn_cpu_job(self, fit: Optional[Tuple[float, float]]) -> None:
        """The running pipeline's CPU job fit, (fixed seconds, seconds per context token of a row over every
        layer), or None: staggered steps are predicted with it instead of the profile's rate. The profile is
        cached per machine, and a bandwidth probe taken while the host was busy would cap the rows for good."""
        self.cpu_job = fit

    def step_s(self, gpu_requests: int, cpu_requests: int, context: float) -> float:
        """Predicted decode step with that many requests per pool, corrected by the measurements so far."""
        plan = "overlap" if cpu_requests else "never"
        step = self.model.predict(plan, max(gpu_requests, 0), cpu_requests, context).step_s
        return step * (self.correction if cpu_requests else self.never_correction)

    def admit_host(self, gpu_requests: int, cpu_requests: int, context: float) -> bool:
        """Whether one more request on the host pool raises the predicted tokens/s."""
        before = (gpu_requests + cpu_requests) / self.step_s(gpu_requests, cpu_requests, context)
        after = (gpu_requests + cpu_requests + 1) / self.step_s(gpu_requests, cpu_requests + 1, context)
        return after > before * (1 + self.margin)

    def observe(self, gpu_requests: int, cpu_requests: int, context: float, measured_s: float) -> None:
        """A decode step took `measured_s`: updates its kind's correction (mean over the last ~20 steps)."""
        host = int(cpu_requests > 0)
        predicted = self.model.predict("overlap" if host else "never", gpu_requests, cpu_requests, context).step_s
        self.observed[host] += 1
        weight = max(1.0 / self.observed[host], 0.05)
        ratio = measured_s / max(predicted, 1e-9)
        if host:
            self.correction += weight * (ratio - self.correction)
        else:
            self.never_correction += weight * (ratio - self.never_correction)

    def observe_staggered(self, gpu_requests: int, cpu_rows: float, context: float, measured_s: float,
                          job_s: Optional[float] = None, host_context: Optional[float] = None) -> None:
        """A decode step of the staggered engine (`cpu_rows` host rows per layer in its block, 0: GPU-only) took
        `measured_s`: its residual over the model joins its kind's host gap. context: the device rows' mean
        context; host_context: the host rows' (None: `context`). job_s: the measured CPU job's fitted time for
        those rows; a step it bounds is predicted by it, so that rows beyond what the job fits (which the measured
        rows already cap) do not read as a gap of every row count."""
        predicted = self._model_step(gpu_requests, cpu_rows, context, host_context).step_s
        if cpu_rows and job_s:
            predicted = max(predicted, job_s)
        self.gap.observe(bool(cpu_rows), predicted, measured_s)

    def _model_step(self, gpu_requests: int, cpu_rows: float, context: float,
                    host_context: Optional[float] = None) -> Prediction:
        """The model's staggered step, or without host rows its GPU-only step."""
        return self.model.predict("staggered" if cpu_rows else "never", gpu_requests, cpu_rows, context,
                                  cpu_job=self.cpu_job, cpu_context=host_context)

    def _staggered_step(self, gpu_requests: int, cpu_rows: int, context: float,
                        host_context: Optional[float] = None) -> Prediction:
        """`_model_step` plus its kind's learned host gap."""
        p = self._model_step(gpu_requests, cpu_rows, context, host_context)
        return dataclasses.replace(p, step_s=max(p.step_s + self.gap.seconds(bool(cpu_rows)), 1e-6))

    def stagger_rows(self, gpu_requests: int, context: float, width: int, keep: bool = False,
                     host_context: Optional[float] = None, hold: bool = False) -> int:
        """Host rows per step (0..width) for the staggered plan beside `gpu_requests` device rows of
        `context`-token requests, its host rows' requests of `host_context` tokens (None: `context`): the count
        with the most predicted tokens/s, 0 unless it beats GPU-only by `stagger_margin` (then no request enters
        the pipeline); keep: for a running pipeline, by `stagger_keep_margin` instead; hold: for a closed one's
        members, by `stagger_hold_margin`. Each kind of step is predicted with its host gap learned so far
        (`observe_staggered`): the GPU-only step's, measured beside the same host work, is not flattered."""
        never = self._staggered_step(gpu_requests, 0, context).tokens_per_s
        best = self._best_staggered(gpu_requests, context, width, host_context)
        margin = (self.stagger_hold_margin if hold else self.stagger_keep_margin if keep else self.stagger_margin)
        return best.cpu_requests if best and best.tokens_per_s > never * (1 + margin) else 0

    def _best_staggered(self, gpu_requests: int, context: float, width: int,
                        host_context: Optional[float] = None) -> Optional[Prediction]:
        """The staggered plan's prediction at its best host row count in 1..width (None when width < 1)."""
        return max((self._staggered_step(gpu_requests, rows, context, host_context) for rows in range(1, width + 1)),
                   key=lambda p: p.tokens_per_s, default=None)

    def worth_staggering(self, gpu_tokens: int, cpu_tokens: int, max_seqs: int, contexts: Sequence[int],
                         width: int) -> bool:
        """Whether the staggered plan pays for some typical load (these contexts, the device pool full, the
        host pool holding `stagger_groups` requests per row): then offload="auto" builds its pipeline. A
        device pool that cannot hold one such request gains from any host row."""
        for context in contexts:
            gpu = min(max_seqs, gpu_tokens // max(context, 1))
            rows = min(width, cpu_tokens // max(context, 1) // self.stagger_groups)
            if rows > 0 and self.stagger_rows(gpu, context, rows):
                return True
        return False

    def worth_enabling(self, gpu_tokens: int, cpu_tokens: int, max_seqs: int, contexts: Sequence[int]) -> bool:
        """Whether any typical load (these contexts, pools as large as given) gains from host requests: if none
        does, the engine never runs the host pool (and never compiles the overlapped graph)."""
        for context in contexts:
            gpu = min(max_seqs, gpu_tokens // max(context, 1))
            cpu = min(max_seqs - gpu, cpu_tokens // max(context, 1))
            if cpu > 0 and gpu > 0 and self.admit_host(gpu, 0, context):
                return True
        return False

    def explain(self, gpu_tokens: int, cpu_tokens: int, max_seqs: int, context: int) -> List[str]:
        """The model's verdict for a load of `context`-token requests filling the device pool."""
        gpu = max(min(max_seqs, gpu_tokens // max(context, 1)), 1)
        cpu = max(min(max_seqs - gpu, cpu_tokens // max(context, 1)), 0)
        pool_rows = cpu_tokens // max(context, 1) // self.stagger_groups  # rows the host pool can fill
        width = min(pool_rows, self.max_stagger_rows)
        lines = self.model.explain(gpu, cpu, context, plans=("never", "overlap"))
        rows = self.stagger_rows(gpu, context, width)
        never = self._staggered_step(gpu, 0, context)
        best = self._best_staggered(gpu, context, width) or never
        calibrated = "calibrated by the captured graphs" if self.model.is_calibrated(True) else "not yet calibrated"
        calibrated += (f", host gap learned {self.gap.seconds(False) * 1e3:+.2f} ms GPU-only, "
                       f"{self.gap.seconds(True) * 1e3:+.2f} ms staggered")
        lines.append(f"staggered plan ({calibrated}): at best {best.cpu_requests} host row(s) per step "
                     f"({best.cpu_requests * self.stagger_groups} host requests in flight), model predicts "
                     f"{best.tokens_per_s:.0f} vs {never.tokens_per_s:.0f} tokens/s GPU-only "
                     f"({best.tokens_per_s / never.tokens_per_s - 1:+.1%}; it needs {self.stagger_margin:+.0%}): "
                     f"{rows} row(s)")
        # per-token latency: a device row gains a token per step, a pipeline member one per stagger_groups steps
        lines.insert(-1, f"TPOT predicted: {never.step_s * 1e3:.2f} ms GPU-only; staggered plan "
                     f"{best.step_s * 1e3:.2f} ms for device rows, {best.step_s * self.stagger_groups * 1e3:.0f} ms "
                     f"for host requests (a token per {self.stagger_groups} steps): the pipeline serves a batch's "
                     f"makespan, never an online latency objective")
        # what the host pool allows at all: each row holds stagger_groups requests (a token per step per row)
        bound = pool_rows / never.step_s
        lines.insert(-1, f"host-pool bound of the staggered plan: {pool_rows} row(s) of {self.stagger_groups} "
                         f"requests of {context} tokens, so at most +{bound:.0f} tokens/s at the GPU-only step "
                         f"({bound / self.model.ideal_gain(context):.2f} of ideal_gain)")
        return lines

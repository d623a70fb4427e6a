"""The staggered plan: host requests' tokens cross the decoder one layer per turn, their CPU attention beside
whole GPU steps (the machinery: `apex_compile.runtime.stagger`).

While its pipeline is active a step is led by the staggered block (`width` rows, the pipeline's groups) and
runs the staggered compiled step (built with the `stagger` pass) or its own graphs: whole decode graphs
(`stagger_graphs`), whole mixed graphs (`stagger_mixed`), pieces (`stagger_pieces`), all over rows that
include the block. An idle pipeline's steps are GPU-only steps (`GpuOnlyPlan.forward`). The block's host work
runs after the forward and the sampling are queued (`after_launch`: this step's q/k/v to the CPU job, the next
step's `begin_step`), so it overlaps the GPU's step.

Under offload="auto" the plan also runs the ceiling's control loop: the host rows per step the performance
model predicts best (`update_ceiling`, with hysteresis), parking an emptied pipeline's requests into the device
pool, moving members to the device pool as it frees room, and teaching the model its host gap from decode steps.
"""
import contextlib
import math
import warnings
from typing import List, Optional, Tuple

import numpy as np
import torch

from apex_compile.runtime.cuda_graphs import (PIECEWISE_MAX_TOKENS, DecodeGraphs, MixedGraphs, PiecewiseGraphs,
                                              piecewise_sizes)
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL
from apex_compile.runtime.plans.base import typical_contexts
from apex_compile.runtime.plans.gpu_only import GpuOnlyPlan, rows_of
from apex_compile.runtime.request import Request, RequestStatus
from apex_compile.runtime.stagger import LauncherPin, StaggerPipeline, rope_tables
from apex_compile.runtime.step_buffers import DeviceIds

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


class StaggeredPlan(GpuOnlyPlan):
    """The staggered pipeline's steps, graphs, job threads and (offload="auto") the ceiling's control loop."""

    name = "staggered"

    def __init__(self, engine, width):
        super().__init__(engine)
        self.pipeline: StaggerPipeline = self.make_pipeline(width)
        self.block_width = self.pipeline.width
        # the threads that call step() kept off the CPU attention worker's cores (a CUDA worker only)
        cores = getattr(getattr(self.pipeline, "executor", None), "cores", None)
        pin = bool(engine.config.pin_launcher)  # off by default (ApexConfig.pin_launcher)
        self._launcher = LauncherPin(cores) if cores and engine.device.type == "cuda" and pin else None
        self._pipeline_due = False  # a staggered forward was queued and its `_advance_pipeline` not yet run
        # the auto ceiling's state (`update_ceiling`)
        self._ceiling_key = None  # (device rows, context bucket, calibration state) of the last auto ceiling
        self._verdicts = {}  # the model's host rows at that key, per margin ("rise", "keep", "hold")
        self.model_rows = 0  # the last of them asked (e2e_hybrid records it)
        self._rise_steps = 0  # steps in a row the model's rows were > 0 while the ceiling stayed 0
        self._fall_steps = 0  # steps in a row the model's rows were 0 while the ceiling of a used pipeline was not
        self.stagger_graphs: Optional[DecodeGraphs] = None  # whole staggered decode steps per capture size
        self.stagger_pieces: Optional[PiecewiseGraphs] = None  # the staggered graph's pieces
        self.stagger_mixed: Optional[MixedGraphs] = None  # whole staggered mixed steps
        self.stagger_step_fn = None
        self._batch_verdict = None  # (requests added, requests queued, verdict) of the last `batch_pays`

    def make_pipeline(self, width) -> StaggerPipeline:
        """The staggered plan's pipeline of `width` rows per step, or "auto": `TuningConfig.auto_stagger_width`
        rows, those in use following the measured CPU job (the compiled step is needed: its passes swap the rows
        per layer)."""
        engine = self.engine
        adaptive = width == "auto"
        width = engine.config.tuning.auto_stagger_width if adaptive else width
        if not engine.config.compile:
            raise ValueError("offload='staggered' needs ApexConfig(compile=True): the staggered rows are swapped "
                             "per layer by the compiler's passes")
        config = engine.model.config
        # the profiled CPU rate bounds the adaptive rows' job fit (auto has a profile)
        policy = engine.auto_policy
        prior = policy.model.cpu_seconds_per_token() / engine.shape.num_layers if policy else None
        return StaggerPipeline(engine.kv, width, config.hidden_size, config.num_attention_heads,
                               rope_tables(engine.model, engine.max_model_len), engine.device, engine.dtype,
                               engine.max_model_len, engine.config.cpu_attention_threads, adaptive, prior,
                               lanes=engine.stagger_lanes, job_share=engine.config.tuning.job_share)

    @staticmethod
    def pays(engine) -> bool:
        """offload="auto": whether the model predicts the staggered plan gains for some typical load."""
        width = engine.config.stagger_width
        width = engine.config.tuning.auto_stagger_width if width in (None, "auto") else width
        kv = engine.kv
        tokens = [p.num_blocks * kv.block_size for p in kv.pools]
        return engine.auto_policy.worth_staggering(tokens[DEVICE_POOL], tokens[HOST_POOL],
                                                   engine.config.max_num_seqs, typical_contexts(engine), width)

    # ----------------------------------------------------------------------------------------------------
    # construction

    def build_graphs(self, max_rows: int) -> None:
        super().build_graphs(max_rows)
        if self.pieces is None:
            return
        width = self.block_width
        # the staggered graph's pieces (rows include the block): every step up to PIECEWISE_MAX_TOKENS, and the
        # pipeline prompt steps past it (uncaptured, their host time outgrew their GPU time: DECISIONS 48)
        rows = max_rows + width + self.engine.config.tuning.pipeline_prompt_tokens
        self.stagger_pieces = PiecewiseGraphs(piecewise_sizes(rows), rows, self.pieces.pool)
        self.stagger_graphs = DecodeGraphs([n for n in self.sizes if n <= max_rows])
        if self.mixed is not None:
            self.stagger_mixed = MixedGraphs(piecewise_sizes(max_rows + width), self.pieces.pool)

    def build_steps(self) -> None:
        super().build_steps()
        self.stagger_step_fn = self.engine._build_step(stagger=True)

    def _step_fn(self, stagger_rows: int):
        return self.stagger_step_fn if stagger_rows else self.step_fn

    # ----------------------------------------------------------------------------------------------------
    # offload="auto": the ceiling's control loop and the host gap

    def update_ceiling(self) -> None:
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
        (`gap_sample`, `observe_gap`), and predicts the CPU job by the pipeline's measured job fit once there
        is one (`AutoOffload.learn_cpu_job`)."""
        engine = self.engine
        running = engine.scheduler.running
        if not running:
            return
        stagger = self.pipeline
        policy = engine.auto_policy
        calibration = engine.calibration
        device = [r for r in running if engine.kv.pool_of(r.request_id) == DEVICE_POOL]
        context = sum(r.num_tokens for r in running) / len(running)
        host_context = stagger.rows.context or None  # the job's rows' own context (they lag the device rows')
        fits = min(stagger.width, stagger.rows.measured)
        used = bool(stagger.rows.ceiling and stagger.num_members)  # a running pipeline: the lower keep margin
        gap = policy.gap
        fit = stagger.rows.job_fit()  # the measured job (kept until an idle probe drops it): not the profile's
        policy.learn_cpu_job(fit)
        key = (len(device), int(context) // 32, int(host_context or 0) // 32, len(calibration.rows),
               calibration.stagger_width, fits,
               round(gap.seconds(False) * 1e4), round(gap.seconds(True) * 1e4),  # gaps in 0.1 ms
               fit and (round(fit[0] * 1e4), round(math.log(max(fit[1], 1e-15)) * 50)))  # rate in 2% steps

        def verdict(margin: str) -> int:  # the model's rows at that margin ("rise", "keep", "hold"), cached by key
            if self._ceiling_key != key:
                self._ceiling_key, self._verdicts = key, {}
            if margin not in self._verdicts:
                self._verdicts[margin] = policy.stagger_rows(
                    len(device), context, fits, keep=margin != "rise", host_context=host_context,
                    hold=margin == "hold")
            self.model_rows = self._verdicts[margin]
            return self.model_rows

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
        if self._members_stay():  # a batch's members entered for its makespan: they keep their rows, none joins
            held = max(held, stagger.rows.ceiling)
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

    def _members_stay(self) -> bool:
        """Under the makespan objective, while requests wait, a falling verdict closes the pipeline at its rows
        rather than parking its members: each entered because it finishes sooner there than waiting
        (`PipelineRules.pays`, the batch simulated with it staying: `batch_pays`), and a parked member resumes in
        the device pool ahead of the waiting requests. On an H200 400 x (1024 + 256) batch the fall parked 98 of
        164 members while requests waited (DECISIONS 45). Once nothing waits they move to the device pool as it
        has room (`_migrate_to_device`) or, at a ceiling of 0, are parked."""
        scheduler = self.engine.scheduler
        return scheduler.objective == "makespan" and bool(scheduler.waiting) and bool(self.pipeline.num_members)

    def attach(self, scheduler) -> None:
        if self.engine.config.offload == "auto":
            scheduler.pipeline_rules.batch_gate = self.batch_pays

    def batch_pays(self) -> bool:
        """offload="auto" with the makespan objective: whether the batch as it stands (running, parked, waiting
        requests and members) is predicted to end sooner, by BATCH_MARGIN, with the pipeline taking the queue's
        tail where each request finishes sooner there than without new members (`batch_model.batch_verdict`, both
        simulated from now). Predicted again once requests were added or the queue fell to half of what the
        last prediction saw. It runs on the launching thread, a few microseconds per simulated step (DECISIONS 45
        has its cost on the CI machine)."""
        from apex_compile.runtime.batch_model import batch_verdict, engine_limits, engine_state

        engine = self.engine
        scheduler = engine.scheduler
        queued = len(scheduler.waiting) + len(scheduler.parked)
        last = self._batch_verdict
        if last is not None and last[0] == engine.requests_added and queued > last[1] // 2:
            return last[2]
        lengths, state = engine_state(engine)
        try:
            verdict = batch_verdict(engine.auto_policy, lengths, engine_limits(engine), state)[2]
        except RuntimeError as error:  # a simulation that did not end: GPU-only, which is never slower
            warnings.warn(f"offload='auto': the batch model could not predict this batch ({error}); no request "
                          f"enters the staggered pipeline for it", RuntimeWarning, stacklevel=2)
            verdict = False
        self._batch_verdict = (engine.requests_added, queued, verdict)
        return verdict

    def gap_sample(self) -> Optional[Tuple[int, float, float, Optional[float], Optional[float]]]:
        """offload="auto": (device rows, the block's host rows per layer, mean context of the device rows, that of
        the job's rows, the measured job fit's seconds for those rows) of the step about to run, whose wall time
        (GPU-bound once steps are queued ahead) teaches the model its host gap: predicted at the same two
        contexts as auto's verdict (`update_ceiling`)."""
        engine = self.engine
        stagger = self.pipeline
        if engine.config.offload != "auto" or engine.auto_policy is None:
            return None
        running = engine.scheduler.running
        if not (running or stagger.num_members):
            return None
        # prompt turns of the pipeline (its own bookkeeping, which idles with it) or prompt K/V still exporting
        if (stagger.active and not stagger.measures_decode) or engine.runner.exports.queued():
            return None
        on_device = [r.num_tokens for r in running if engine.kv.pool_of(r.request_id) == DEVICE_POOL]
        rows = stagger.host_rows
        host_context = stagger.rows.context or None
        context = sum(on_device) / len(on_device) if on_device else (host_context or 0.0)
        return len(on_device), rows, context, host_context, stagger.rows.job_seconds(rows) if rows else None

    def observe_gap(self, sample, seconds: float) -> None:
        device, rows, context, host_context, job_s = sample
        self.engine.auto_policy.observe_staggered(device, rows, context, seconds, job_s, host_context=host_context)

    # ----------------------------------------------------------------------------------------------------
    # before a step

    def enter_step(self) -> None:
        if self._launcher is not None:
            self._launcher.ensure()

    def before_schedule(self) -> None:
        """The ceiling (auto), then the pipeline's members: an emptied pipeline's requests parked, members
        moved to the device pool, stalled ones recomputed, parked ones rejoining; an empty pipeline's idle step."""
        engine = self.engine
        if engine.config.offload == "auto":
            self.update_ceiling()
        self._park_idle_pipeline()
        self._migrate_to_device()
        engine.stats.recomputed += len(engine.scheduler.pipeline_rules.unstall())
        engine.scheduler.pipeline_rules.join_parked()
        if not self.pipeline.num_members:
            self.pipeline.idle_step()

    def begin_step(self) -> None:
        stagger = self.pipeline
        if stagger.num_members and not (stagger.begun and stagger.active):
            stagger.begin_step()  # else begun by the step before, while the GPU ran it

    def _park_idle_pipeline(self) -> None:
        """A staggered pipeline whose ceiling is 0 (offload="auto": host rows no longer pay) empties as its
        requests sample (`_row_limit`); once none is inside, those waiting to rejoin are parked (with their host
        KV) so that they resume in the device pool, rather than keeping every step staggered for a row each.
        Only requests whose last token the host has (a step queued ahead may still be sampling the others')."""
        stagger = self.pipeline
        if stagger.rows.ceiling or stagger.inside or not stagger.joining:
            return
        ready = [r.request_id for r in stagger.joining if r.num_computed < r.num_tokens]
        if not ready:
            return
        stagger.executor.drain()  # nothing may still read their blocks as they shrink (no job holds them now)
        for request in stagger.remove(ready):
            self.engine.scheduler.pipeline_rules.park(request)
            self.engine.stats.emptied += 1

    def _migrate_to_device(self) -> None:
        """Pipeline members move to the device pool where it has room for them: there a member gains a token per
        step instead of one per lanes x (layers + 1) steps, and PCIe moves its KV in milliseconds. Members with the
        most tokens left go first (those nearly done finish as soon where they are). A marked member leaves at its
        next token boundary (`StaggerPipeline.leaving`); once its token is on the host it is parked with its host
        KV and resumes in the device pool ahead of waiting requests (`Scheduler.schedule`). Members are marked only
        while no request waits: until then the device pool's room goes to waiting requests, which make no progress
        elsewhere, while a member still gains its token per cycle (moving members ahead of them lengthened a
        batch's makespan past GPU-only's)."""
        engine = self.engine
        stagger, scheduler, kv = self.pipeline, engine.scheduler, engine.kv
        ready = [r.request_id for r in stagger.joining
                 if r.request_id in stagger.leaving and r.num_computed < r.num_tokens]
        if ready:
            stagger.executor.drain()  # nothing may still read their blocks as they move
            for request in stagger.remove(ready):
                scheduler.pipeline_rules.park(request)
                scheduler.to_device.add(request.request_id)
                engine.stats.migrated += 1
        if scheduler.waiting:
            return
        members = stagger.members()
        leaving = [r for r in members if r.request_id in stagger.leaving]
        slots = engine.config.max_num_seqs - len(scheduler.running) - len(scheduler.parked) - len(leaving)
        if slots <= 0:
            return

        def need(request) -> int:  # its whole table in the device pool, and its growth reserve
            return kv.blocks_for(scheduler._reserve_target(request))

        room = (kv.num_free(DEVICE_POOL) + kv.num_held(DEVICE_POOL)
                - scheduler._running_need(lookahead=scheduler.parks_ahead, reserve=True)
                - sum(need(r) for r in list(scheduler.parked) + leaving))
        rest = lambda r: scheduler.max_tokens(r) - r.num_tokens  # noqa: E731
        for request in sorted((r for r in members if r.request_id not in stagger.leaving), key=rest, reverse=True):
            if slots <= 0 or need(request) > room:
                break
            stagger.leaving.add(request.request_id)
            room -= need(request)
            slots -= 1

    # ----------------------------------------------------------------------------------------------------
    # the step

    def lead_rows(self) -> int:
        """The staggered block's width while the pipeline is active, else 0."""
        return self.pipeline.width if self.pipeline.active else 0

    def lead_sampling_rows(self) -> List[Tuple[int, Request]]:
        """The staggered block's last group: its token is through every layer."""
        return self.pipeline.sampling_rows() if self.pipeline.active else []

    def lead_input_rows(self) -> List[Tuple[int, Request]]:
        """The block's group-0 rows (one lane: a request re-enters group 0 the step after it sampled)."""
        return self.pipeline.pending_input_rows() if self.pipeline.active else []

    def ahead_graphs(self):
        return self.stagger_graphs if self.pipeline.active else self.graphs

    def _quiet(self, active):
        """While graphs of the staggered step are captured: their uncaptured runs leave the pipeline as it was
        (`StaggerPipeline.quiet`)."""
        if not active:
            return contextlib.nullcontext()
        return self.pipeline.quiet()

    def quiet(self):
        """The pipeline left as it is by the runs inside (graph captures, a benchmark's replays)."""
        return self._quiet(True)

    def fill_staggered(self, chunks, logit_rows, pad_to=None, total_rows=None):
        """StepBuffers.fill for a step led by the staggered block; a whole graph's step (pad_to) computes the
        logits of every row."""
        buffers = self.engine.buffers
        parts, num_rows = buffers.fill(chunks, logit_rows, pad_to=pad_to, total_rows=total_rows,
                                       first_row=self.pipeline.width)
        if pad_to is not None:
            buffers.logits_indices[:num_rows] = np.arange(num_rows)
        return parts, num_rows

    def capture_stagger_graphs(self, progress: bool = True) -> None:
        """Captures the whole-step graphs of staggered decode steps (the block and padded device decode rows),
        every capture size (done by `warmup`, else at the first such step)."""
        graphs = self.stagger_graphs
        if graphs is None or graphs.ready:
            return
        buffers = self.engine.buffers
        width = self.pipeline.width
        padded = {}

        def prepare(size):
            padded[size] = self.fill_staggered([], [], pad_to=size)[0]
            buffers.ids[:width], buffers.positions[:width] = 0, 0
            buffers.copy_to_device()

        def forward(size):
            return self.run_model(padded[size], width + size, width + size, stagger_rows=width)

        with self._quiet(True):
            graphs.capture(prepare, forward, progress, self.pieces.pool)
            rows, seconds = graphs.time_replays()
        calibration = self.engine.calibration
        calibration.stagger_rows, calibration.stagger_s = rows, seconds
        calibration.stagger_width = width

    def warmup(self) -> None:
        """The decode graphs, then the staggered step compiled (a quiet step of padding rows) and its graphs."""
        super().warmup()
        buffers = self.engine.buffers
        width = self.pipeline.width
        parts, _ = buffers.fill([], [], pad_to=2, first_row=width)
        buffers.ids[:width], buffers.positions[:width] = 0, 0
        buffers.copy_to_device()
        with self._quiet(True):
            self.run_model(parts, width + 2, 2, stagger_rows=width)
        self.capture_stagger_graphs()
        self._time_piece_captures()

    def _time_piece_captures(self) -> None:
        """offload="auto" with CUDA graphs: captures the pieces of the largest pipeline prompt step, then of one
        halfway up the sizes past PIECEWISE_MAX_TOKENS, and keeps the second's seconds as the price the batch
        model gives each such size a run meets first (`StepCalibration.piece_capture_s`; the batch gate weighs
        them against the pipeline's gain). The largest goes first, as the decode graphs do, so that the graph
        pool holds its memory and it pays what the first large step of the process pays."""
        pieces = self.stagger_pieces
        if pieces is None or self.engine.auto_policy is None:
            return
        large = [size for size in pieces.sizes if size > PIECEWISE_MAX_TOKENS]
        for rows in dict.fromkeys((large[-1], large[len(large) // 2]) if large else ()):
            key = pieces.key_for(rows, 1)  # the logits rows of a step of `rows`: LOGITS_FLOOR
            if key in pieces.pieces:  # (a second warm-up: the price stays the first's)
                continue
            before = pieces.capture_seconds
            self._capture_pieces(pieces, key, self.pipeline.width)
            self.engine.calibration.piece_capture_s = pieces.capture_seconds - before

    def captured_seconds(self) -> float:
        return sum(g.capture_seconds for g in (self.pieces, self.stagger_pieces, self.mixed, self.stagger_mixed)
                   if g is not None)

    def forward(self, chunks, logit_rows: List[int], device_ids: Optional[DeviceIds] = None) -> torch.Tensor:
        """A step led by the staggered block while the pipeline is active, else a GPU-only step."""
        if any(not c.decodes for c in chunks):
            self.pipeline.note_prompt_step()  # the row limit leaves this step out of its decode-step measures
        if self.pipeline.active:
            return self._forward_staggered(chunks, logit_rows, device_ids)
        return super().forward(chunks, logit_rows, device_ids)

    def _forward_staggered(self, chunks, logit_rows: List[int], device_ids: Optional[DeviceIds] = None
                           ) -> torch.Tensor:
        """`forward` of a step led by the staggered block: a whole-step graph when the device rows all decode, a
        whole mixed graph when they hold prompt chunks that fit its layout (`MixedGraphs`), else the staggered
        graph in pieces or (without CUDA graphs, above their sizes) as compiled.
        The block's host work is done after the forward is queued: `end_step` (this step's q/k/v to the CPU),
        then the next step's `begin_step`; only `collect` (the CPU's outputs to the device) comes before it."""
        engine = self.engine
        buffers, runner = engine.buffers, engine.runner
        stagger = self.pipeline
        self._advance_pipeline()  # a caller that skipped it (nothing does): the lanes stay in order anyway
        width = stagger.width
        num_tokens = width + sum(c.num_tokens for c in chunks)
        size = None
        if self.stagger_graphs is not None and all(c.pool == DEVICE_POOL and c.decodes for c in chunks):
            size = self.stagger_graphs.size_for(max(len(chunks), 1))
            if size is not None and not self.stagger_graphs.ready:
                self.capture_stagger_graphs()
        pieces = self.stagger_pieces
        mixed = (self._mixed_key(self.stagger_mixed, chunks, num_tokens, len(logit_rows), width) if size is None
                 else None)
        key = (pieces.key_for(num_tokens, len(logit_rows)) if pieces is not None and size is None and mixed is None
               else None)
        if key is not None and key not in pieces.pieces:
            self._capture_pieces(pieces, key, width)
        num_logits = len(logit_rows)
        if size is None:
            padded = mixed or key
            padded_logits = padded[1] if padded is not None else self.logits_rows(num_logits)
            padded_rows = (logit_rows + [num_tokens - 1] * padded_logits)[:padded_logits]
        else:
            padded_rows = logit_rows
        if mixed is not None:
            parts, num_rows = buffers.fill(chunks, padded_rows, first_row=width, mixed_rows=mixed[0] - width)
        else:
            parts, num_rows = self.fill_staggered(chunks, padded_rows, pad_to=size, total_rows=key and key[0])
        buffers.ids[:width] = stagger.input_ids()  # (0 where the token is still on its way: device_ids)
        buffers.positions[:width] = stagger.groups[0].positions
        buffers.copy_to_device(device_ids)
        stagger.collect()
        start = engine._tick("prepare")
        runner.set_parts(parts, num_rows, width)
        if size is not None:
            logits = rows_of(self.stagger_graphs.replay(size), logit_rows)
        elif mixed is not None:
            logits = self.stagger_mixed.replay(mixed)[:num_logits]
        elif key is not None:
            with torch.inference_mode():
                logits = pieces.replay(key, runner)[:num_logits]
        else:
            logits = self.run_model(parts, num_rows, len(padded_rows), stagger_rows=width)[:num_logits]
        self._pipeline_due = True  # `_advance_pipeline`, once the caller queued what it wants before it
        engine.stats.forward_seconds += engine._tick("forward") - start
        engine.stats.steps += 1
        for chunk in chunks:
            chunk.request.num_computed += chunk.num_tokens
        return logits

    def after_launch(self, lead_sampled: List[Tuple[int, Request]]) -> None:
        """The sampled block rows' tokens are through every layer (counted before the pipeline's next turn: one
        lane re-enters it at once, at its next position); then the block's host work."""
        for _, request in lead_sampled:
            request.num_computed += 1
            request.steps_per_pool[HOST_POOL] += 1
        self._advance_pipeline()

    def _advance_pipeline(self) -> None:
        """After a staggered forward is queued (and the sampled ids' copy behind it): `end_step` (this step's
        q/k/v to the CPU job), then the next step's `begin_step`, host work done while the GPU runs the step;
        their device copies queue behind the sampled ids, so the host gets its tokens without waiting for them."""
        if not self._pipeline_due:
            return
        self._pipeline_due = False
        stagger = self.pipeline
        stagger.end_step(self.engine.runner)
        if stagger.num_members:
            stagger.begin_step()
        self.engine._tick("pipeline")

    def took_token(self, request: Request) -> None:
        """A request prefilled in the host pool decodes staggered from its first token on."""
        if request.status is RequestStatus.RUNNING and self.engine.kv.pool_of(request.request_id) == HOST_POOL:
            self.engine.scheduler.pipeline_rules.join(request)

    def close(self) -> None:
        try:
            if self._launcher is not None:
                self._launcher.release()
        finally:
            self.pipeline.close()
